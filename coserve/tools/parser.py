"""Reading tool calls out of generated text, whole or as it streams (`tool_choice` `auto`, and the
replies a grammar forced).

The text is split into content and calls at the family's tags (`family.ToolFamily`). A block between
an open and a close tag is a call when it holds a JSON object with a string `name` and an object
`arguments` (a string holding a JSON object is taken too); anything else, a malformed call included,
stays in the content as the model wrote it, as does an open tag that is never closed. Whitespace that
touches a call (the newlines around the tags) is dropped; other text is kept exactly. The streaming
parser and `parse_tool_calls` give the same result: the latter is the former fed everything at once.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from coserve.tools.family import ToolFamily


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: a fresh `call_...` id, the function's name, its arguments as compact JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParsedOutput:
    """A whole reply: its content (None when the calls were all of it) and its calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def new_call_id() -> str:
    """An id in OpenAI's shape (`call_` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def read_call(block: str) -> ParsedCall | None:
    """The call a block between the tags holds, or None when it is not one (see the module doc)."""
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(id=new_call_id(), name=data["name"],
                      arguments=json.dumps(arguments, ensure_ascii=False))


def _prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be a tag still arriving)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class StreamingToolParser:
    """Splits text arriving in pieces into content pieces and complete calls.

    `feed` returns what can be told apart so far; text that may still become a tag or the whitespace
    before one is held back until the next piece (or `finish`) decides it.
    """

    def __init__(self, family: ToolFamily) -> None:
        self._open = family.open_tag
        self._close = family.close_tag
        self._pending = ""  # outside a call: undecided text; inside: the call's text so far
        self._inside = False
        self._scanned = 0  # inside: where in `_pending` the close tag may still start (no rescans)
        self._gap = ""  # the whitespace before the open tag: kept if the block is no call
        self._after_call = False  # whitespace right after a call is dropped
        self.calls: list[ParsedCall] = []  # every call so far

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Add generated text; returns (content that is now certain, calls completed by it)."""
        self._pending += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self._inside:
                end = self._pending.find(self._close, self._scanned)
                if end < 0:
                    self._scanned = max(0, len(self._pending) - len(self._close) + 1)
                    break
                self._scanned = 0
                block, self._pending = self._pending[:end], self._pending[end + len(self._close):]
                self._inside = False
                call = read_call(block.strip())
                if call is None:  # not a call: the model's text, as written
                    content.append(self._gap + self._open + block + self._close)
                    self._after_call = False
                else:
                    calls.append(call)
                    self._after_call = True
                continue
            if self._after_call:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    break
                self._after_call = False
            start = self._pending.find(self._open)
            if start < 0:
                keep = _prefix_overlap(self._pending, self._open)
                certain = self._pending[:len(self._pending) - keep]
                stripped = certain.rstrip()  # whitespace before a possible call waits too
                content.append(stripped)
                self._pending = self._pending[len(stripped):]
                break
            before = self._pending[:start]
            content.append(before.rstrip())
            self._gap = before[len(before.rstrip()):]
            self._pending = self._pending[start + len(self._open):]
            self._inside = True
        self.calls.extend(calls)
        return "".join(content), calls

    def finish(self) -> str:
        """The end of the text: what was held back is content (an unclosed call as written)."""
        rest = (self._gap + self._open + self._pending) if self._inside else self._pending
        if self._after_call and not self._inside:
            rest = rest.lstrip()
        self._pending, self._inside = "", False
        return rest


def parse_tool_calls(text: str, family: ToolFamily) -> ParsedOutput:
    """The calls in a whole reply and the content around them (content unchanged when there are none)."""
    parser = StreamingToolParser(family)
    content, calls = parser.feed(text)
    content += parser.finish()
    return ParsedOutput(content=content or None if calls else content, calls=calls)
