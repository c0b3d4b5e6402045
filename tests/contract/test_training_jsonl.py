"""The strict JSON of training files (`coserve.contract.training_jsonl`), read the same at upload and when a
job is prepared: what it refuses and the line and place it names, and what it reads as before."""

from __future__ import annotations

import json

import pytest

from coserve.contract.training_jsonl import (
    MAX_JSON_DEPTH,
    MAX_ROW_BYTES,
    JsonTextError,
    RowError,
    jsonl_rows,
    loads_strict,
    read_rows,
)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("text", "reason"), [
    ('{"a": "x\\ud800"}', "a lone surrogate (\\ud800) in a:"),
    ('{"a": [1, {"b": "\\udc00y"}]}', "a lone surrogate (\\udc00) in a[1].b:"),
    ('{"a": {"k\\udfff": 1}}', "a lone surrogate (\\udfff) in a key of a:"),
    ('["ok", "\\ud83d"]', "a lone surrogate (\\ud83d) in [1]:"),  # the first half of a pair, alone
    ('{"weird key!": "\\ud800"}', "in ['weird key!']"),
    ('{"a": NaN}', "NaN is not a JSON value"),
    ('[-Infinity]', "-Infinity is not a JSON value"),
    ("1" * 5000, "a number with more than 4300 digits"),
    (_nested(MAX_JSON_DEPTH + 1), f"nested deeper than {MAX_JSON_DEPTH} levels"),
    (_nested(100_000), f"nested deeper than {MAX_JSON_DEPTH} levels"),  # past the C decoder's own bound
    ("{not json", "not valid JSON (Expecting property name"),
])
def test_what_a_training_file_may_not_hold(text: str, reason: str) -> None:
    with pytest.raises(JsonTextError) as err:
        loads_strict(text)
    assert reason in str(err.value)


def test_what_it_reads_as_json_does() -> None:
    for value in [{"a": "\U0001f600 \u2028 \\ud800"}, _nested(MAX_JSON_DEPTH), {"n": 10 ** 4000}, "[1e999]"]:
        text = value if isinstance(value, str) else json.dumps(value)
        assert loads_strict(text) == json.loads(text)
    assert loads_strict('"\\ud83d\\ude00"') == "\U0001f600"  # a surrogate pair is one character


def test_rows_name_their_line() -> None:
    data = b'\xef\xbb\xbf{"a": 1}\n\n{"b": 2}\r\n{"c": "\\u2028 is not a line break"}\n'
    assert list(jsonl_rows(data)) == [(1, {"a": 1}), (3, {"b": 2}), (4, {"c": "\u2028 is not a line break"})]
    for data, line, reason in [(b'{}\n{}\n\xed\xa0\x80', 3, "not valid UTF-8 (byte 0xed at byte 1"),
                               (b'{}\n\n{"x": "\\ud800"}', 3, "a lone surrogate"),
                               (b'{}\n\xef\xbb\xbf{}', 2, "not valid JSON"),  # a byte-order mark only opens a file
                               (b'{}\n' + _nested(200).encode(), 2, "nested deeper"),
                               (b'{}\n\n' + json.dumps(["x" * MAX_ROW_BYTES]).encode(), 3,
                                f"bytes long; a row holds at most {MAX_ROW_BYTES} bytes")]:
        with pytest.raises(RowError) as err:
            read_rows(data)
        assert err.value.line == line and reason in err.value.reason, err.value
