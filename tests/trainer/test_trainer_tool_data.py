"""Fine-tuning data with tools (issue 20 item 5): OpenAI's function-calling rows rendered with the
chat template's tool format and masked exactly.

The masks are checked by decoding, as in test_trainer_data.py: each run of trained tokens must decode
to one trained assistant turn as the template writes it after the generation prompt (content, then
Qwen's `<tool_call>` blocks, then `<|im_end|>`), so tool definitions, headers, tool results and
weight-0 turns are untrained. Templates that would drop tools, calls, arguments or results are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from coserve.model.chat_templates import CHATML_TEMPLATE, QWEN_TOOLS_TEMPLATE
from trainer_data import TemplateError, encode_example, prepare_dataset

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You help with travel."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [  # parallel calls, compact JSON arguments
        _call("call_1", "get_weather", '{"city":"Paris"}'), _call("call_2", "get_weather", '{"city": "Rome"}')]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "Rain, 17C"},
    {"role": "assistant", "content": "Paris: sunny, 21C. Rome: rain, 17C."},
    {"role": "user", "content": "And the time in Rome?"},
    {"role": "assistant", "weight": 0, "tool_calls": [_call("call_3", "get_time", '{"tz": "Europe/Berlin"}')]},
    {"role": "tool", "tool_call_id": "call_3", "content": "wrong zone"},
    {"role": "assistant", "content": "Let me check Rome.", "tool_calls": [  # content and a call (no `content`
        _call("call_4", "get_time", '{"tz": "Europe/Rome"}')]},                # key above: absent is fine too)
]


def _block(name: str, arguments: str) -> str:
    """Qwen's text for one call; arguments as `tojson` writes the parsed object."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


EXPECTED_RUNS = [
    _block("get_weather", '{"city": "Paris"}') + "\n" + _block("get_weather", '{"city": "Rome"}') + "<|im_end|>",
    "Paris: sunny, 21C. Rome: rain, 17C.<|im_end|>",
    "Let me check Rome.\n" + _block("get_time", '{"tz": "Europe/Rome"}') + "<|im_end|>",
]


def _trained_runs(tokenizer: Any, ids: list[int], trained: list[bool]) -> list[str]:
    runs: list[list[int]] = []
    current: list[int] = []
    for token, flag in zip(ids, trained):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen_tokenizer(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Any:
    return AutoTokenizer.from_pretrained(model_dirs[request.param])


def test_tool_call_turns_train_the_call_text_and_end_marker(qwen_tokenizer: Any) -> None:
    tokenizer = qwen_tokenizer
    encoded = encode_example(tokenizer, CONVERSATION, max_len=4000, tools=TOOLS)
    ids, trained = encoded.token_ids.tolist(), encoded.trained.tolist()
    assert _trained_runs(tokenizer, ids, trained) == EXPECTED_RUNS
    text = tokenizer.decode(ids)
    assert "<tools>\n" + json.dumps(TOOLS[0]) in text  # the tools are in the prompt, untrained
    untrained = tokenizer.decode([t for t, f in zip(ids, trained) if not f])
    assert untrained.count("<|im_start|>assistant") == 4  # every header, tool-call turns included
    for result in ("Sunny, 21C", "Rain, 17C", "wrong zone", '"tz": "Europe/Berlin"', "You help with travel."):
        assert result in untrained  # tool results, the weight-0 call and the system text
    assert encoded.num_trained == sum(len(tokenizer(run, add_special_tokens=False)["input_ids"])
                                      for run in EXPECTED_RUNS)


def test_a_row_may_end_on_the_call_and_run_without_tools(qwen_tokenizer: Any) -> None:
    messages = CONVERSATION[1:3]  # no system message, ends on the call
    with_tools = encode_example(qwen_tokenizer, messages, max_len=4000, tools=TOOLS)
    without = encode_example(qwen_tokenizer, messages, max_len=4000)
    for encoded in (with_tools, without):
        runs = _trained_runs(qwen_tokenizer, encoded.token_ids.tolist(), encoded.trained.tolist())
        assert runs == EXPECTED_RUNS[:1]
    assert with_tools.full_length > without.full_length  # only the prompt grew


def test_weight_zero_tool_call_rows_are_skipped(qwen_tokenizer: Any) -> None:
    messages = [CONVERSATION[1], {**CONVERSATION[2], "weight": 0}]
    data = prepare_dataset(qwen_tokenizer, [{"messages": messages, "tools": TOOLS}], max_len=4000)
    assert (data.num_skipped, data.trained_tokens) == (1, 0)


@pytest.mark.parametrize("template", ["chatml", "smollm2"])
def test_templates_without_tool_support_are_refused(template: str, model_dirs: dict[str, Path],
                                                    request: pytest.FixtureRequest) -> None:
    if template == "smollm2":  # the real model's template writes role and content only
        tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_dir"))
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
        assert tokenizer.chat_template == CHATML_TEMPLATE
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    for row in ({"messages": CONVERSATION, "tools": TOOLS}, {"messages": CONVERSATION[1:3]},
                {"messages": CONVERSATION[1:3], "tools": TOOLS}, {**plain, "tools": TOOLS}):
        with pytest.raises(TemplateError, match="training example 2: the base model's chat template "
                                                "does not render (tool calls|the 'tools' list)"):
            prepare_dataset(tokenizer, [plain, row], max_len=4000)
    assert prepare_dataset(tokenizer, [plain], max_len=4000).trained_tokens > 0  # plain rows still train


def _qwen_with(tokenizer: Any, old: str, new: str) -> Any:
    assert old in QWEN_TOOLS_TEMPLATE
    tokenizer.chat_template = QWEN_TOOLS_TEMPLATE.replace(old, new)
    return tokenizer


@pytest.mark.parametrize(("old", "new", "what"), [
    ("{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}", "", "the 'tools' list"),
    ("{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}", "{%- endif %}", "tool calls"),
    # Writes the probe's arguments (key "x") but no others: caught on the example's own rendering.
    ("{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}",
     "{%- if tool_call['arguments']['x'] is not defined %}{}", "tool-call arguments"),
    ("'\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>'",
     "'\\n<tool_response></tool_response>'", "this tool result"),
])
def test_templates_that_drop_part_of_the_tool_data_are_refused(model_dirs: dict[str, Path], old: str,
                                                               new: str, what: str) -> None:
    tokenizer = _qwen_with(AutoTokenizer.from_pretrained(model_dirs["qwen2"]), old, new)
    with pytest.raises(TemplateError, match=f"does not render {what}"):
        encode_example(tokenizer, CONVERSATION, max_len=4000, tools=TOOLS)


def test_template_errors_become_template_errors(model_dirs: dict[str, Path]) -> None:
    """A template's own `raise_exception` (or a jinja error) names the example, so the job fails with
    invalid_training_file instead of escaping the job manager as a jinja exception."""
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["qwen2"])
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(TemplateError, match="training example 1: .*roles must alternate"):
        prepare_dataset(tokenizer, [{"messages": CONVERSATION[1:3]}], max_len=4000)


def test_arguments_that_are_not_json_are_refused(qwen_tokenizer: Any) -> None:
    bad = [CONVERSATION[1], {"role": "assistant", "tool_calls": [_call("c", "get_weather", "{city: Paris}")]}]
    with pytest.raises(ValueError, match="message 1, tool call 0: 'arguments' is not valid JSON"):
        encode_example(qwen_tokenizer, bad, max_len=4000, tools=TOOLS)
