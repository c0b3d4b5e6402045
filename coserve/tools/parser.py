"""What reading tool calls out of generated text gives, whatever the family's format (`tool_choice`
`auto`, and the replies a grammar forced).

Each family (`family.ToolFamily`) has a streaming parser (`CallParser`): text goes in as it is
generated, content that is certain and complete calls come out. A call is a JSON object with a string
`name` and an object of arguments (a string holding a JSON object is taken too); text that is not a
call, a malformed or unfinished one included, stays in the content as the model wrote it. Whitespace
that touches a call is dropped; other text is kept exactly. The whole-reply reading (`parse_all`) is the
streaming parser fed everything at once, so both give the same result.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: a fresh `call_...` id, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParsedOutput:
    """A whole reply: its content (None when the calls were all of it) and its calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class CallParser(Protocol):
    """Splits text arriving in pieces into content pieces and complete calls (one per reply)."""

    calls: list[ParsedCall]  # every call so far

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Add generated text; returns (content that is now certain, calls completed by it)."""
        ...

    def finish(self) -> str:
        """The end of the text: what was held back is content (an unfinished call as written)."""
        ...


def new_call_id() -> str:
    """An id in OpenAI's shape (`call_` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_from_object(data: Any, argument_keys: Sequence[str] = ("arguments",)) -> ParsedCall | None:
    """The call a decoded JSON value is, or None: an object with a non-empty string `name` and its
    arguments under the first of `argument_keys` it has (absent: no arguments), an object or a string
    holding one. Other keys (Mistral's `id`) are ignored."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    key = next((key for key in argument_keys if key in data), None)
    arguments = {} if key is None else data[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(id=new_call_id(), name=data["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def read_call(block: str, argument_keys: Sequence[str] = ("arguments",)) -> ParsedCall | None:
    """The call a block of text holds (a JSON object, see `call_from_object`), or None."""
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    return call_from_object(data, argument_keys)


def prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be a tag still arriving)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def run_steps(step: Callable[[list[str], list[ParsedCall]], bool]) -> tuple[str, list[ParsedCall]]:
    """A streaming parser's `feed` loop: call `step` until it needs more text; returns (content that is now
    certain, calls completed)."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    while step(content, calls):
        pass
    return "".join(content), calls


def parse_all(parser: CallParser, text: str) -> ParsedOutput:
    """The calls in a whole reply and the content around them (content unchanged when there are none)."""
    content, calls = parser.feed(text)
    content += parser.finish()
    return ParsedOutput(content=content or None if calls else content, calls=calls)
