"""A model's tool-call family is found from its chat template, by rendering a call and reading it back:
the real Llama 3.2 and Mistral Nemo templates, Qwen's, and ChatML (no family); Mistral's 9-character
call ids; the system message that describes tools to a template that renders none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coserve.frontend.chat_render import template_messages
from coserve.frontend.template_family import probe_call_turn, template_family
from coserve.frontend.tokenizer import Tokenizer
from coserve.tools.call_ids import nine_char_id
from coserve.tools.family import HERMES, LLAMA3_JSON, MISTRAL, detect_family
from coserve.tools.system_prompt import DESCRIBED_FAMILY, tools_description, with_tools_described

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_each_tiny_model_has_its_templates_family(model_dirs: dict[str, Path],
                                                  tool_model_dirs: dict[str, Path]) -> None:
    expected = [(model_dirs["qwen2"], HERMES), (model_dirs["qwen3"], HERMES), (model_dirs["llama"], None),
                (model_dirs["mistral"], None), (tool_model_dirs["llama3.2"], LLAMA3_JSON),
                (tool_model_dirs["mistral"], MISTRAL)]
    for folder, family in expected:
        assert template_family(Tokenizer.from_pretrained(folder)) is family, folder


def test_the_probe_turn_is_the_call_as_the_template_writes_it(tool_model_dirs: dict[str, Path]) -> None:
    llama = probe_call_turn(Tokenizer.from_pretrained(tool_model_dirs["llama3.2"]))
    assert llama == '{"name": "coserve_probe_tool", "parameters": {"x": "coserve_probe_value"}}<|eot_id|>'
    mistral = probe_call_turn(Tokenizer.from_pretrained(tool_model_dirs["mistral"]))
    assert mistral == ('[TOOL_CALLS][{"name": "coserve_probe_tool", "arguments": {"x": "coserve_probe_value"}, '
                       '"id": "coserveP1"}]</s>')


def test_detection_needs_exactly_the_probe_call() -> None:
    turn = '<|python_tag|>{"name": "p", "parameters": {"x": 1}}'
    assert detect_family(turn, "p", {"x": 1}) is LLAMA3_JSON
    assert detect_family(turn, "p", {"x": 2}) is None
    assert detect_family(turn, "q", {"x": 1}) is None
    assert detect_family(turn + "; " + turn[len("<|python_tag|>"):], "p", {"x": 1}) is None  # two calls
    assert detect_family("", "p", {}) is None and detect_family(None, "p", {}) is None


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    assert nine_char_id("a1B2c3D4e") == "a1B2c3D4e"  # already right: kept
    made = {nine_char_id(call_id) for call_id in ("call_1", "call_2", "call_" + "x" * 24, "ab", "a1B2c3D4é")}
    assert len(made) == 5 and all(len(i) == 9 and i.isascii() and i.isalnum() for i in made)
    assert nine_char_id("call_1") == nine_char_id("call_1")
    messages = [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    call, result = template_messages(messages, MISTRAL.call_id)
    assert call["tool_calls"][0]["id"] == result["tool_call_id"] == nine_char_id("call_1")
    assert call["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert template_messages(messages, HERMES.call_id)[1]["tool_call_id"] == "call_1"  # others: as given


def test_the_tools_description_for_templates_without_tools() -> None:
    text = tools_description([TOOL])
    assert text.startswith("# Tools\n\nYou may call one or more functions")
    assert "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in text
    assert text.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    assert DESCRIBED_FAMILY is HERMES  # the format the text asks for is the one read back
    user = {"role": "user", "content": "hi"}
    assert with_tools_described([user], [TOOL]) == [{"role": "system", "content": text}, user]
    system = {"role": "system", "content": "Be brief."}
    assert with_tools_described([system, user], [TOOL])[0] == {"role": "system", "content": "Be brief.\n\n" + text}
    parts = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    described = with_tools_described([parts, user], [TOOL])[0]["content"]
    assert described == [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "\n\n" + text}]
    assert parts["content"] == [{"type": "text", "text": "Be brief."}]  # the request's message is left as it was


@pytest.mark.parametrize("family", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda family: family.name)
def test_every_family_reads_its_own_forced_shape(family) -> None:
    """The text a family's grammar forces (its layout) is read back as the calls it holds."""
    layout = family.layout
    call = (layout.call_open + '{"name": "now", "' + layout.arguments_key + '": {"a": [1, "]"]}}'
            + layout.call_close)
    calls = min(2, layout.max_calls)
    parsed = family.parse(layout.before + layout.separator.join([call] * calls) + layout.after)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("now", {"a": [1, "]"]})] * calls
