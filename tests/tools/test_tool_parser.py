"""The Hermes/Qwen tool-call parser (`tool_choice` `auto`) on hand-written model outputs: whole replies
and the same text streamed in pieces give the same content and calls."""

from __future__ import annotations

import json

import pytest

from coserve.tools.family import HERMES
from coserve.tools.parser import ParsedOutput

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def _calls(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def _streamed(text: str, size: int) -> tuple[str, list[tuple[str, dict]]]:
    parser = HERMES.new_parser()
    content, calls = "", []
    for start in range(0, len(text), size):
        piece, done = parser.feed(text[start:start + size])
        content += piece
        calls += [(c.name, json.loads(c.arguments)) for c in done]
    return content + parser.finish(), calls


def test_one_call_is_the_whole_reply() -> None:
    parsed = HERMES.parse(WEATHER)
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", {"city": "Paris", "unit": "c"})]
    call = parsed.calls[0]
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call.arguments == '{"city": "Paris", "unit": "c"}'


def test_two_calls_in_order_with_distinct_ids() -> None:
    parsed = HERMES.parse(WEATHER + "\n" + TIME)
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", {"city": "Paris", "unit": "c"}), ("now", {})]
    assert parsed.calls[0].id != parsed.calls[1].id


def test_text_and_a_call() -> None:
    parsed = HERMES.parse("Let me look that up.\n" + WEATHER)
    assert parsed.content == "Let me look that up."
    assert _calls(parsed) == [("get_weather", {"city": "Paris", "unit": "c"})]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',   # cut JSON
    '<tool_call>\n{"arguments": {}}\n</tool_call>',                                  # no name
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',                 # not an object
    'Sure <tool_call>\n{"name": "get_weather", "arguments": {}}',                    # never closed
])
def test_malformed_calls_stay_content_as_written(text: str) -> None:
    parsed = HERMES.parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_a_malformed_call_beside_a_good_one() -> None:
    bad = '<tool_call>\n{oops}\n</tool_call>'
    parsed = HERMES.parse(f"{bad}\n{TIME}")
    assert parsed.content == bad and _calls(parsed) == [("now", {})]


def test_text_without_calls_is_unchanged() -> None:
    for text in ["", "Hello", "  spaces  \n", "a < b and <tool> is not <tool_call", "x <tool_call"]:
        assert HERMES.parse(text) == ParsedOutput(content=text, calls=[])


def test_arguments_written_as_a_json_string_are_read() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"q\\": 1}"}\n</tool_call>'
    assert _calls(HERMES.parse(text)) == [("f", {"q": 1})]


@pytest.mark.parametrize("text", [
    WEATHER, WEATHER + "\n" + TIME, "Let me look.\n" + WEATHER + "\nDone.", "no calls at all <tool_",
    "a <tool_call>\n{bad}\n</tool_call> b", "tail <tool_call>\n{\"name\": \"f\"",
])
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streaming_in_pieces_gives_what_the_whole_text_gives(text: str, size: int) -> None:
    whole = HERMES.parse(text)
    content, calls = _streamed(text, size)
    assert calls == _calls(whole)
    assert (content or None if calls else content) == whole.content


def test_streaming_holds_back_only_what_may_start_a_call() -> None:
    parser = HERMES.new_parser()
    assert parser.feed("Hello <tool") == ("Hello", [])   # " <tool" may open a call
    assert parser.feed("box> ok") == (" <toolbox> ok", [])
    content, calls = parser.feed("\n" + TIME)
    assert content == "" and [c.name for c in calls] == ["now"]
