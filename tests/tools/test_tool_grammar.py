"""The grammar that forces tool calls, checked with llguidance on the tiny qwen2 model's tokenizer: it
accepts exactly the family's call text with schema-valid arguments; and how a template's family is
detected."""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from coserve.model.chat_templates import CHATML_TEMPLATE, QWEN_TOOLS_TEMPLATE
from coserve.structured.llguidance_grammar import grammar_text
from coserve.tools.call_grammar import MAX_PARALLEL_CALLS, tool_call_grammar
from coserve.tools.family import HERMES, detect_family
from coserve.tools.spec import ToolChoiceMode, ToolSpec

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1}}}}}
NOW = {"type": "function", "function": {"name": "now"}}


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.fixture(scope="module")
def accepts(model_dirs: dict[str, Path]):
    hf = AutoTokenizer.from_pretrained(model_dirs["qwen2"])
    tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=[hf.eos_token_id])

    def check(spec: ToolSpec, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(tool_call_grammar(HERMES, spec)))
        ids = hf.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids) and matcher.try_consume_tokens(ids) == len(ids) \
            and matcher.is_accepting()
    return check


def test_required_takes_any_declared_function_with_valid_arguments(accepts) -> None:
    spec = ToolSpec([WEATHER, NOW], ToolChoiceMode.REQUIRED, None, parallel=False)
    assert accepts(spec, _call("get_weather", '{"city": "Paris", "days": 2}'))
    assert accepts(spec, _call("get_weather", '{"city": "Paris"}'))
    assert accepts(spec, _call("now", "{}"))  # no `parameters`: an empty argument list
    assert not accepts(spec, _call("now", '{"x": 1}'))
    assert not accepts(spec, _call("get_weather", '{"days": 2}'))              # `city` is required
    assert not accepts(spec, _call("get_weather", '{"city": "Montevideo"}'))   # maxLength 8
    assert not accepts(spec, _call("get_weather", '{"city": "Paris", "days": 0}'))
    assert not accepts(spec, _call("get_time", "{}"))                         # not declared
    assert not accepts(spec, "Sure. " + _call("now", "{}"))                   # nothing but the call
    assert not accepts(spec, _call("now", "{}") + "\n" + _call("now", "{}"))  # parallel_tool_calls false
    assert not accepts(spec, _call("get_weather", '{"city":"Paris"}'))        # one JSON layout


def test_parallel_calls_up_to_the_bound(accepts) -> None:
    spec = ToolSpec([WEATHER, NOW], ToolChoiceMode.REQUIRED, None, parallel=True)
    two = _call("get_weather", '{"city": "Oslo"}') + "\n" + _call("now", "{}")
    assert accepts(spec, two)
    assert accepts(spec, "\n".join([_call("now", "{}")] * MAX_PARALLEL_CALLS))
    assert not accepts(spec, "\n".join([_call("now", "{}")] * (MAX_PARALLEL_CALLS + 1)))


def test_a_named_function_is_the_only_one_allowed(accepts) -> None:
    spec = ToolSpec([WEATHER, NOW], ToolChoiceMode.FUNCTION, "now", parallel=True)
    assert accepts(spec, _call("now", "{}"))
    assert not accepts(spec, _call("get_weather", '{"city": "Oslo"}'))


def test_family_detection_from_the_template(model_dirs: dict[str, Path]) -> None:
    assert detect_family(QWEN_TOOLS_TEMPLATE) is HERMES
    assert detect_family(CHATML_TEMPLATE) is None
    assert detect_family(None) is None
    for arch, family in (("qwen2", HERMES), ("qwen3", HERMES), ("llama", None), ("mistral", None)):
        template = AutoTokenizer.from_pretrained(model_dirs[arch]).chat_template
        assert detect_family(template) is family, arch
