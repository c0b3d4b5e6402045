"""The grammar that forces tool calls, checked with llguidance on the tokenizer of a tiny model of each
family (hermes: qwen2; llama3_json and mistral: the tiny models with the real Llama 3.2 and Mistral Nemo
templates): it accepts exactly the family's call text with schema-valid arguments."""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from coserve.structured.llguidance_grammar import grammar_text
from coserve.tools.call_grammar import MAX_PARALLEL_CALLS, tool_call_grammar
from coserve.tools.family import HERMES, LLAMA3_JSON, MISTRAL, ToolFamily
from coserve.tools.spec import ToolChoiceMode, ToolSpec

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1}}}}}
NOW = {"type": "function", "function": {"name": "now"}}


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _checker(model_dir: Path, family: ToolFamily):
    """`check(spec, text)`: whether the grammar of `spec` in `family`'s format accepts exactly `text`."""
    hf = AutoTokenizer.from_pretrained(model_dir)
    tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=[hf.eos_token_id])

    def check(spec: ToolSpec, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(tool_call_grammar(family, spec)))
        ids = hf.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids) and matcher.try_consume_tokens(ids) == len(ids) \
            and matcher.is_accepting()
    return check


@pytest.fixture(scope="module")
def accepts(model_dirs: dict[str, Path]):
    return _checker(model_dirs["qwen2"], HERMES)


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


def _llama(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "parameters": {arguments}}}'


def test_llama_calls_are_the_templates_json_one_call_a_reply(tool_model_dirs: dict[str, Path]) -> None:
    accepts = _checker(tool_model_dirs["llama3.2"], LLAMA3_JSON)
    spec = ToolSpec([WEATHER, NOW], ToolChoiceMode.REQUIRED, None, parallel=True)
    assert accepts(spec, _llama("get_weather", '{"city": "Paris", "days": 2}'))
    assert accepts(spec, _llama("now", "{}"))
    # The template renders one call per assistant message: one call, even with parallel_tool_calls.
    assert not accepts(spec, _llama("now", "{}") + "; " + _llama("now", "{}"))
    assert not accepts(spec, '{"name": "now", "arguments": {}}')  # the template's key is "parameters"
    assert not accepts(spec, _llama("get_weather", '{"city": "Montevideo"}'))
    assert not accepts(spec, "<|python_tag|>" + _llama("now", "{}"))  # the template writes no tag
    named = ToolSpec([WEATHER, NOW], ToolChoiceMode.FUNCTION, "get_weather", parallel=True)
    assert not accepts(named, _llama("now", "{}"))


def _mistral(*calls: tuple[str, str]) -> str:
    return "[" + ", ".join(f'{{"name": "{name}", "arguments": {arguments}}}' for name, arguments in calls) + "]"


def test_mistral_calls_are_one_bare_array(tool_model_dirs: dict[str, Path]) -> None:
    accepts = _checker(tool_model_dirs["mistral"], MISTRAL)
    spec = ToolSpec([WEATHER, NOW], ToolChoiceMode.REQUIRED, None, parallel=True)
    assert accepts(spec, _mistral(("get_weather", '{"city": "Oslo"}')))
    assert accepts(spec, _mistral(("get_weather", '{"city": "Oslo"}'), ("now", "{}")))
    assert accepts(spec, _mistral(*[("now", "{}")] * MAX_PARALLEL_CALLS))
    assert not accepts(spec, _mistral(*[("now", "{}")] * (MAX_PARALLEL_CALLS + 1)))
    assert not accepts(spec, "[]")
    assert not accepts(spec, '{"name": "now", "arguments": {}}')  # not in an array
    assert not accepts(spec, "[TOOL_CALLS]" + _mistral(("now", "{}")))  # vLLM's forced shape: no marker
    single = ToolSpec([WEATHER, NOW], ToolChoiceMode.FUNCTION, "now", parallel=False)
    assert accepts(single, _mistral(("now", "{}")))
    assert not accepts(single, _mistral(("now", "{}"), ("now", "{}")))
    assert not accepts(single, _mistral(("get_weather", '{"city": "Oslo"}')))


def test_auto_with_a_structured_output_is_calls_or_that_output(model_dirs: dict[str, Path]) -> None:
    """`tool_choice` auto beside a JSON schema output (the Agents SDK's `output_type` with tools): the reply
    is the calls of a forced reply, or JSON valid against the schema; nothing else."""
    from coserve.contract.structured_output import StructuredOutput
    from coserve.tools.call_grammar import calls_or_output_grammar

    hf = AutoTokenizer.from_pretrained(model_dirs["qwen2"])
    tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=[hf.eos_token_id])
    output = StructuredOutput.json_schema({"type": "object", "additionalProperties": False, "required": ["answer"],
                                           "properties": {"answer": {"type": "integer"}}})
    grammar = grammar_text(calls_or_output_grammar(HERMES, ToolSpec([WEATHER, NOW], ToolChoiceMode.AUTO), output))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        ids = hf.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    assert accepts(_call("now", "{}"))
    assert accepts(_call("now", "{}") + "\n" + _call("get_weather", '{"city": "Oslo"}'))
    assert accepts('{"answer": 42}')
    assert not accepts('{"answer": "42"}') and not accepts("42") and not accepts(_call("get_time", "{}"))
    with pytest.raises(ValueError):
        calls_or_output_grammar(HERMES, ToolSpec([NOW], ToolChoiceMode.AUTO), StructuredOutput.lark('start: "x"\n'))
