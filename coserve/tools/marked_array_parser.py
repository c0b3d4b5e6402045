"""Calls as a JSON array after a marker: Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...},
"id": ...}, ...]` (Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small 3.x templates; vLLM's pre-v11 `mistral`
parser).

`[TOOL_CALLS]` is a special token: decoding drops it unless the request keeps special tokens, and a
call forced by a grammar is written without it (as vLLM forces Mistral calls). So a reply that opens
with `[` (after whitespace) is read as an array of calls too; elsewhere in the text only the marker
opens one. The value after the marker is a call array (every element a call object; `id` is ignored)
or one call object; anything else stays content, marker included, as written.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from coserve.tools.json_scan import JsonEnd
from coserve.tools.parser import ParsedCall, call_from_object, prefix_overlap, run_steps


class _At(enum.Enum):
    START = enum.auto()  # the reply's start: whitespace, the marker, or a bare array
    TEXT = enum.auto()  # content, up to the next marker
    MARKED = enum.auto()  # after the marker: whitespace, then the calls' value
    VALUE = enum.auto()  # inside the value
    AFTER = enum.auto()  # after calls: their whitespace is dropped


def read_calls(text: str) -> list[ParsedCall]:
    """The calls a JSON value holds: an array of call objects, or one; [] when it is neither."""
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [call_from_object(item) for item in items]
    if not calls or any(call is None for call in calls):
        return []
    return [call for call in calls if call is not None]


class MarkedArrayCallParser:
    """A `parser.CallParser` for call arrays after `marker` (see the module doc)."""

    def __init__(self, marker: str) -> None:
        self._marker = marker
        self._raw = ""  # text not given out yet, as written
        self._cursor = 0  # where in `_raw` reading goes on
        self._at = _At.START
        self._scan = JsonEnd()
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Add generated text; returns (content that is now certain, calls completed by it)."""
        self._raw += text
        content, calls = run_steps(self._step)
        self.calls.extend(calls)
        return content, calls

    def _step(self, content: list[str], calls: list[ParsedCall]) -> bool:
        """Read on from `_cursor`; False when more text is needed."""
        if self._at is _At.TEXT:
            return self._text(content)
        if self._at is _At.VALUE:
            return self._value(content, calls)
        rest = self._raw[self._cursor:]
        stripped = rest.lstrip()
        if not stripped or (self._at is _At.START and len(stripped) < len(self._marker)
                            and self._marker.startswith(stripped)):
            return False  # only whitespace, or what may still be the marker
        if self._at is _At.AFTER:
            self._raw, self._cursor, self._at = stripped, 0, _At.TEXT
            return True
        self._cursor += len(rest) - len(stripped)
        if self._at is _At.START and stripped.startswith(self._marker):
            self._cursor, self._at = self._cursor + len(self._marker), _At.MARKED
        elif stripped[0] == "[" or (self._at is _At.MARKED and stripped[0] == "{"):
            self._at, self._scan = _At.VALUE, JsonEnd()
        elif self._at is _At.START:
            self._cursor, self._at = 0, _At.TEXT
        else:  # a marker with no value after it: content, as written
            content.append(self._raw[:self._cursor])
            self._raw, self._cursor, self._at = self._raw[self._cursor:], 0, _At.TEXT
        return True

    def _text(self, content: list[str]) -> bool:
        start = self._raw.find(self._marker)
        if start < 0:
            keep = prefix_overlap(self._raw, self._marker)
            certain = self._raw[:len(self._raw) - keep].rstrip()  # whitespace before a marker waits too
            content.append(certain)
            self._raw = self._raw[len(certain):]
            return False
        before = self._raw[:start].rstrip()
        content.append(before)
        self._raw = self._raw[len(before):]  # the whitespace before the marker, then the marker
        self._cursor, self._at = start - len(before) + len(self._marker), _At.MARKED
        return True

    def _value(self, content: list[str], calls: list[ParsedCall]) -> bool:
        text = self._raw[self._cursor:]
        end = self._scan.find(text)
        if end is None:
            return False
        found = read_calls(text[:end])
        stop = self._cursor + end
        if found:
            calls.extend(found)
        else:
            content.append(self._raw[:stop])
        self._raw, self._cursor, self._at = self._raw[stop:], 0, _At.AFTER if found else _At.TEXT
        return True

    def finish(self) -> str:
        """The end of the text: what was held back is content (an unclosed value as written)."""
        rest = self._raw.lstrip() if self._at is _At.AFTER else self._raw
        self._raw, self._cursor, self._at = "", 0, _At.TEXT
        return rest
