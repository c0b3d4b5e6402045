"""Hypothesis over the fine-tuning upload check (`validate_finetune_jsonl`): whatever bytes or JSON a tenant
uploads, the answer is the file's summary or the 400 naming a line, never another exception (a 500); and
whatever it accepts, the job's preparation reads back row for row (`read_rows`, the same strict reader).

Three sources of uploads: arbitrary bytes, arbitrary JSON (lone surrogates, deep nesting and long numbers
among the values), and valid rows of every kind (chat with tools, DPO, reinforcement) with parts replaced
by arbitrary JSON, the inputs that reach deepest into the row checks. Derandomized (tests/suite_guards.py).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.files import validate_finetune_jsonl
from coserve.contract.training_jsonl import read_rows

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                           "strict": True}}]
VALID_ROWS: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "c1", "content": "r"},
                  {"role": "assistant", "content": "a", "weight": 1}], "tools": TOOLS, "parallel_tool_calls": False},
    {"input": {"messages": [{"role": "user", "content": "u"}], "tools": TOOLS, "parallel_tool_calls": True},
     "preferred_output": [{"role": "assistant", "content": "a"}],
     "non_preferred_output": [{"role": "assistant", "content": "b"}]},
    {"messages": [{"role": "user", "content": "u"}], "answer": "4", "meta": {"x": [1, 2]}},
]
# Written as a number of 5,000 digits (more than Python's int conversion takes) in place of the string.
BIG_NUMBER = "<a number of 5000 digits>"
# Text with lone surrogates among other characters (json.dumps writes them as \\udxxx escapes).
texts = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.characters(), max_size=6)
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts
           | st.sampled_from(["user", "assistant", "system", "tool", "developer", "function", "[[[[", BIG_NUMBER]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(texts | st.sampled_from(["role", "content", "messages"]), inner, max_size=3),
                      max_leaves=12)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        found += _paths(child, (*path, key))
    return found


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    value = copy.deepcopy(value)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return value


@st.composite
def mutated_rows(draw: st.DrawFn) -> Any:
    row: Any = draw(st.sampled_from(VALID_ROWS))
    for _ in range(draw(st.integers(1, 3))):
        row = _replaced(row, draw(st.sampled_from(_paths(row))), draw(values))
    return row


def _dumps(value: Any) -> bytes:
    return json.dumps(value).replace(json.dumps(BIG_NUMBER), "7" * 5000).encode()


def _check(data: bytes) -> None:
    try:
        summary = validate_finetune_jsonl(data)
    except ProtocolError as err:
        assert (err.status, err.param, err.code) == (400, "file", "invalid_file_format"), err
        err.message.encode("utf-8")  # the answer's JSON can hold it (no lone surrogate echoed back)
        return
    assert len(read_rows(data)) == summary.num_examples  # the job's preparation reads what upload accepted


@SETTINGS
@given(st.binary(max_size=300))
def test_any_bytes(data: bytes) -> None:
    _check(data)


@SETTINGS
@given(st.lists(values, min_size=1, max_size=3))
def test_any_json(rows: list[Any]) -> None:
    _check(b"\n".join(_dumps(row) for row in rows))


@SETTINGS
@given(st.lists(mutated_rows(), min_size=1, max_size=2))
def test_valid_rows_with_parts_replaced(rows: list[Any]) -> None:
    _check(b"\n".join(_dumps(row) for row in rows))


@SETTINGS
@given(st.sampled_from(VALID_ROWS), st.integers(1, 3000), st.sampled_from(["[", "{\"a\":"]))
def test_deep_nesting_anywhere(row: dict[str, Any], depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    text = json.dumps(row)
    at = text.index('"u"') if '"u"' in text else len(text) - 1
    deep = opener * depth + "1" + closer * depth
    _check((text[:at] + deep + text[at + 3:]).encode())
