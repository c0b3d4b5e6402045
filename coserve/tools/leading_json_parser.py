"""Calls as bare JSON objects at the start of a reply: Llama 3.x's JSON tool calls.

Llama 3.1/3.2/3.3 templates write a call as the whole assistant turn, `{"name": ..., "parameters":
{...}}` (vLLM's `llama3_json` parser: `arguments` is taken too), after `<|python_tag|>` in some prompts;
that tag is a special token, so it is only in the text when the request keeps special tokens. As in
vLLM, several calls are separated by `;`. A reply is read as calls only when, after leading whitespace
and the optional tag, it opens with `{`: each object that is a call becomes one, and what follows the
last call (after its whitespace) is content. An object that is no call, or one never closed, leaves
the rest of the reply as content, as written.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from coserve.tools.json_scan import JsonEnd
from coserve.tools.parser import ParsedCall, read_call, run_steps


class _At(enum.Enum):
    START = enum.auto()  # the reply's start: whitespace, the tag, or a call
    NEXT = enum.auto()  # after the tag or a separator: whitespace, then a call
    OBJECT = enum.auto()  # inside a JSON object
    AFTER = enum.auto()  # after a call: whitespace, then a separator or the content
    CONTENT = enum.auto()  # the rest is content


class LeadingJsonCallParser:
    """A `parser.CallParser` for calls at the start of a reply (see the module doc).

    Args:
        tag: the optional text before the first call (`<|python_tag|>`).
        separator: what separates calls (`;`).
        argument_keys: where a call object keeps its arguments, first match wins.
    """

    def __init__(self, tag: str, separator: str, argument_keys: Sequence[str]) -> None:
        self._tag = tag
        self._separator = separator
        self._keys = tuple(argument_keys)
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
        if self._at is _At.CONTENT:
            content.append(self._raw)
            self._raw = ""
            return False
        if self._at is _At.OBJECT:
            return self._end_object(calls)
        rest = self._raw[self._cursor:]
        stripped = rest.lstrip()
        if not stripped or (self._at is _At.START and len(stripped) < len(self._tag)
                            and self._tag.startswith(stripped)):
            return False  # only whitespace, or what may still be the tag
        self._cursor += len(rest) - len(stripped)
        if self._at is _At.AFTER:
            self._raw, self._cursor = stripped, 0  # the whitespace touching a call is dropped
            if stripped.startswith(self._separator):
                self._cursor, self._at = len(self._separator), _At.NEXT
            else:
                self._at = _At.CONTENT
        elif self._at is _At.START and self._tag and stripped.startswith(self._tag):
            self._cursor, self._at = self._cursor + len(self._tag), _At.NEXT
        elif stripped.startswith("{"):
            self._at, self._scan = _At.OBJECT, JsonEnd()
        else:
            self._at = _At.CONTENT  # everything held, as written
        return True

    def _end_object(self, calls: list[ParsedCall]) -> bool:
        text = self._raw[self._cursor:]
        end = self._scan.find(text)
        if end is None:
            return False
        call = read_call(text[:end], self._keys)
        if call is None:
            self._at = _At.CONTENT
            return True
        calls.append(call)
        self._raw, self._cursor, self._at = text[end:], 0, _At.AFTER
        return True

    def finish(self) -> str:
        """The end of the text: what was held back is content (an unclosed object as written)."""
        rest = self._raw.lstrip() if self._at is _At.AFTER else self._raw
        self._raw, self._cursor, self._at = "", 0, _At.CONTENT
        return rest
