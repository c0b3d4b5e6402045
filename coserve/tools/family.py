"""Tool-call text formats of chat-template families, and how a model's family is detected.

A model writes a tool call as text in its own format, which its chat template also uses to render
earlier calls. Supported (vLLM's parser of the same name in brackets):

* **hermes** (`hermes`; Hermes 2/3, Qwen2.5, Qwen3, QwQ, coserve's tiny qwen2/qwen3 models): each call
  is `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, anywhere in the reply, several
  separated by a newline.
* **llama3_json** (`llama3_json`; Llama 3.1, 3.2, 3.3): the reply is the call, `{"name": NAME,
  "parameters": {...}}` (`arguments` is read too), optionally after `<|python_tag|>`, several separated
  by `;`. The templates render one call per assistant message, so a forced reply holds one call.
* **mistral** (`mistral`, pre-v11 tokenizers; Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small 3.x):
  `[TOOL_CALLS][{"name": NAME, "arguments": {...}, "id": ID}, ...]`; a forced reply is the bare array,
  as vLLM forces it. The templates take only 9-character call ids (`call_ids`).

**Detection** (no model names): the frontend renders a probe conversation whose assistant message
calls a probe function (`frontend.template_family.probe_call_turn`), and the family is the one whose
parser reads exactly that call back out of the assistant turn the template wrote. A template whose calls no family
reads has none: its replies are not parsed, and `required` or a named function are refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from coserve.tools.call_ids import keep_id, nine_char_id
from coserve.tools.call_layout import CallLayout
from coserve.tools.leading_json_parser import LeadingJsonCallParser
from coserve.tools.marked_array_parser import MarkedArrayCallParser
from coserve.tools.parser import CallParser, ParsedOutput, parse_all
from coserve.tools.tagged_parser import TaggedCallParser


@dataclass(frozen=True, slots=True)
class ToolFamily:
    """One tool-call text format: how forced calls are written (`layout`), how calls are read
    (`new_parser`, one parser per reply), and the call ids its templates take (`call_id`)."""

    name: str
    layout: CallLayout
    new_parser: Callable[[], CallParser] = field(compare=False, repr=False)
    call_id: Callable[[str], str] = field(default=keep_id, compare=False, repr=False)

    def parse(self, text: str) -> ParsedOutput:
        """The calls in a whole reply and the content around them."""
        return parse_all(self.new_parser(), text)


HERMES = ToolFamily(
    name="hermes",
    layout=CallLayout(call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n"),
    new_parser=partial(TaggedCallParser, "<tool_call>", "</tool_call>"))

LLAMA3_JSON = ToolFamily(
    name="llama3_json",
    layout=CallLayout(arguments_key="parameters", separator="; ", max_calls=1),
    new_parser=partial(LeadingJsonCallParser, "<|python_tag|>", ";", ("arguments", "parameters")))

MISTRAL = ToolFamily(
    name="mistral",
    layout=CallLayout(before="[", after="]", separator=", "),
    new_parser=partial(MarkedArrayCallParser, "[TOOL_CALLS]"),
    call_id=nine_char_id)

FAMILIES: tuple[ToolFamily, ...] = (HERMES, MISTRAL, LLAMA3_JSON)


def detect_family(turn: str | None, name: str, arguments: dict[str, Any]) -> ToolFamily | None:
    """The family whose parser reads exactly one call of `name` with `arguments` out of `turn` (the
    assistant turn a chat template wrote for that call), or None (no template, or no known format)."""
    if not turn:
        return None
    for family in FAMILIES:
        calls = family.parse(turn).calls
        if len(calls) == 1 and calls[0].name == name and json.loads(calls[0].arguments) == arguments:
            return family
    return None
