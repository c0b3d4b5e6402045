"""The Llama 3.x JSON and Mistral `[TOOL_CALLS]` parsers on hand-written model outputs (the formats the
real templates write and vLLM's `llama3_json` and `mistral` parsers read): what is a call, what stays
content as written, and streaming in pieces of any size gives what the whole text gives, for every
family."""

from __future__ import annotations

import json

import pytest

from coserve.tools.family import FAMILIES, HERMES, LLAMA3_JSON, MISTRAL, ToolFamily
from coserve.tools.parser import ParsedOutput


def _calls(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def _streamed(family: ToolFamily, text: str, size: int) -> ParsedOutput:
    parser = family.new_parser()
    content, calls = "", []
    for start in range(0, len(text), size):
        piece, done = parser.feed(text[start:start + size])
        content += piece
        calls += done
    content += parser.finish()
    assert calls == parser.calls
    return ParsedOutput(content=content or None if calls else content, calls=calls)


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
WEATHER = ("get_weather", {"city": "Paris", "unit": "c"})


def test_llama_a_reply_that_is_a_call() -> None:
    parsed = LLAMA3_JSON.parse(LLAMA_CALL)
    assert parsed.content is None and _calls(parsed) == [WEATHER]
    assert parsed.calls[0].id.startswith("call_")
    # vLLM's llama3_json reads `arguments` too, a <|python_tag|> before the call, `;` between calls.
    assert _calls(LLAMA3_JSON.parse('{"name": "now", "arguments": {}}')) == [("now", {})]
    tagged = LLAMA3_JSON.parse(" <|python_tag|>" + LLAMA_CALL + "; " + '{"name": "now", "parameters": {}}\n')
    assert tagged.content is None and _calls(tagged) == [WEATHER, ("now", {})]


def test_llama_text_after_the_calls_is_content() -> None:
    parsed = LLAMA3_JSON.parse(LLAMA_CALL + "<|eot_id|>")  # special tokens kept by the request
    assert parsed.content == "<|eot_id|>" and _calls(parsed) == [WEATHER]


@pytest.mark.parametrize("text", [
    "Hello there",
    "The answer: " + LLAMA_CALL,                      # calls open the reply, or it has none
    '{"city": "Paris"}',                               # an object that is no call
    '{"name": "f", "parameters": [1]}',                # arguments not an object
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut by the token limit
    "<|python_tag|>brave_search.call(query=\"x\")",   # Llama 3.1's built-in tools are not functions
    "  \n",
    "",
])
def test_llama_replies_without_calls_are_content_as_written(text: str) -> None:
    assert LLAMA3_JSON.parse(text) == ParsedOutput(content=text, calls=[])


def test_llama_a_bad_object_after_a_call_is_content() -> None:
    parsed = LLAMA3_JSON.parse(LLAMA_CALL + " ; {oops}")
    assert _calls(parsed) == [WEATHER] and parsed.content == "; {oops}"


MISTRAL_CALLS = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, '
                 '"id": "a1b2c3d4e"}, {"name": "now", "arguments": {}, "id": "f5g6h7i8j"}]')


def test_mistral_the_templates_array_after_the_marker() -> None:
    parsed = MISTRAL.parse(MISTRAL_CALLS)
    assert parsed.content is None and _calls(parsed) == [WEATHER, ("now", {})]
    assert all(call.id.startswith("call_") for call in parsed.calls)  # the model's `id` is not used
    spaced = MISTRAL.parse("[TOOL_CALLS] [" + MISTRAL_CALLS.split("[", 2)[2])  # Mistral 7B v0.3's space
    assert _calls(spaced) == [WEATHER, ("now", {})]
    one = MISTRAL.parse('[TOOL_CALLS]{"name": "now", "arguments": "{}"}')  # one object, string arguments
    assert _calls(one) == [("now", {})]


def test_mistral_text_before_and_after_the_calls() -> None:
    parsed = MISTRAL.parse("Let me check. " + MISTRAL_CALLS + "</s>")
    assert parsed.content == "Let me check.</s>" and len(parsed.calls) == 2


def test_mistral_a_bare_array_opens_a_reply_when_the_marker_was_skipped() -> None:
    """`[TOOL_CALLS]` is a special token: decoding drops it by default, and forced replies have none."""
    parsed = MISTRAL.parse('\n[{"name": "now", "arguments": {}}]')
    assert parsed.content is None and _calls(parsed) == [("now", {})]
    text = 'Sure: [{"name": "now", "arguments": {}}]'  # only at the start, without the marker
    assert MISTRAL.parse(text) == ParsedOutput(content=text, calls=[])


@pytest.mark.parametrize("text", [
    "[citation needed] is a tag",
    "[1, 2, 3]",
    '[TOOL_CALLS][{"name": "now", "arguments": {}}, {"arguments": {}}]',   # one element is no call
    "[TOOL_CALLS] nothing",
    '[TOOL_CALLS][{"name": "now", "arguments": {',                          # cut
    "x [TOOL_CALLS",
    "[TOOL_CALLS][]",
])
def test_mistral_text_without_calls_is_content_as_written(text: str) -> None:
    assert MISTRAL.parse(text) == ParsedOutput(content=text, calls=[])


CASES = {
    HERMES: ['<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "plain text <tool_call"],
    LLAMA3_JSON: [LLAMA_CALL, "<|python_tag|>" + LLAMA_CALL + ";" + LLAMA_CALL + " tail", LLAMA_CALL + " ; {x}",
                  '{"name": "f", "parameters": {"s": "a \\" } ] {"}}', "{not json", "<|python", " plain"],
    MISTRAL: [MISTRAL_CALLS, "a " + MISTRAL_CALLS + " b [TOOL_CALLS][1]", '[{"name": "f", "arguments": {"s": "]}"}}]',
              "[TOOL_CALLS] nothing", "[TOOL_CALL", "[not json", " [TOOL_CALLS][{"],
}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streaming_in_pieces_gives_what_the_whole_text_gives(family: ToolFamily, size: int) -> None:
    for text in CASES[family]:
        whole = family.parse(text)
        streamed = _streamed(family, text, size)
        assert streamed.content == whole.content, text
        assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.calls]


def test_streaming_sends_a_call_as_soon_as_its_json_closes() -> None:
    parser = LLAMA3_JSON.new_parser()
    assert parser.feed('{"name": "now", "parameters": {}') == ("", [])
    content, calls = parser.feed("}")
    assert content == "" and [c.name for c in calls] == ["now"]
    parser = MISTRAL.new_parser()
    assert parser.feed("Hi [TOOL_") == ("Hi", [])  # " [TOOL_" may open the calls
    content, calls = parser.feed('CALLS][{"name": "now", "arguments": {}}]')
    assert content == "" and [c.name for c in calls] == ["now"]
    assert parser.feed(" and more") == ("and more", [])
