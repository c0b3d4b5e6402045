"""Tool-call text formats of chat-template families, and how a model's family is detected.

A model writes a tool call as text in its own format, which its chat template also uses to render
earlier calls. Supported:

* **hermes** (Hermes 2/3, Qwen2.5, Qwen3, QwQ, and coserve's tiny qwen2/qwen3 models): each call is
  `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, several calls one after another
  separated by a newline. Detected when the chat template writes both `<tool_call>` and `</tool_call>`.

Other formats (Mistral's `[TOOL_CALLS]`, Llama 3.1's bare JSON, ...) are not recognised: such a model
can still be given `tools` with `tool_choice` `auto` or `none` when its template renders them, but no
call is read from its text, and `required` or a named function are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolFamily:
    """One tool-call text format: `open` + JSON `{"name": ..., "arguments": {...}}` + `close`, calls
    joined by `separator`. The parser matches the tags without their surrounding whitespace."""

    name: str
    open: str
    close: str
    separator: str

    @property
    def open_tag(self) -> str:
        return self.open.strip()

    @property
    def close_tag(self) -> str:
        return self.close.strip()


HERMES = ToolFamily(name="hermes", open="<tool_call>\n", close="\n</tool_call>", separator="\n")

FAMILIES: tuple[ToolFamily, ...] = (HERMES,)


def detect_family(template: str | None) -> ToolFamily | None:
    """The family whose call tags the chat template writes, or None (no known tool-call format)."""
    if not template:
        return None
    for family in FAMILIES:
        if family.open_tag in template and family.close_tag in template:
            return family
    return None


def template_text(tokenizer: Any) -> str | None:
    """The chat template a request with tools is rendered with (a tokenizer may keep several by name,
    `tool_use` among them); None when it has none."""
    try:
        template: str = tokenizer.get_chat_template(tools=[{"type": "function", "function": {"name": "probe"}}])
    except ValueError:  # no chat template at all
        return None
    return template
