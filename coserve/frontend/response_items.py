"""A Responses API conversation (its items) as the chat messages the chat template renders.

The Responses API speaks in items; chat templates take messages. One conversation, two spellings:

* a `message` item is a message of its role, its text parts joined by newlines (chat's rule);
* `function_call` items are the `tool_calls` of one assistant message: the assistant message right before
  them when it has text (the model wrote text, then its calls), else a message of their own;
* a `function_call_output` item is a `tool` message answering its `call_id`;
* a `reasoning` item is left out (no served model reasons, so it holds another server's thoughts).

So `previous_response_id` and an Agents SDK loop render exactly as the same conversation sent to
`/v1/chat/completions` would, tool calls and their results included. Items are plain dicts, as the
gateway validated them (`coserve.api.protocol.responses_items`) or as the store kept them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def item_text(content: Any) -> str:
    """A message's `content` or a call output's `output` as one string: a string as is, parts' text
    (`input_text`, `output_text`, `refusal`) joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", part.get("refusal", ""))) for part in content)


def _call(item: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def chat_messages(items: Iterable[Mapping[str, Any]], instructions: str | None = None) -> list[dict[str, Any]]:
    """The chat messages of a conversation's items, `instructions` first as a system message."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": item_text(item.get("content"))})
        elif kind == "function_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(_call(item))
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item_text(item.get("output"))})
    return messages

