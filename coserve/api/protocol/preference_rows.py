"""DPO training rows (OpenAI's preference format), checked at upload like chat rows.

A row is `{"input": {"messages": [...], "tools": [...], "parallel_tool_calls": ...},
"preferred_output": [{"role": "assistant", "content": "..."}], "non_preferred_output": [...]}`
(https://platform.openai.com/docs/guides/direct-preference-optimization). The input's messages follow
the chat rules (`files._check_message`) and end with a user turn: the outputs answer it. Each output is
one assistant message with non-empty text content; the two must differ (a pair that prefers an answer to
itself teaches nothing, and its loss gradient is zero).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PREFERENCE_KEYS = frozenset({"input", "preferred_output", "non_preferred_output"})
_INPUT_KEYS = frozenset({"messages", "tools", "parallel_tool_calls"})
OUTPUT_KEYS = ("preferred_output", "non_preferred_output")

MessageCheck = Callable[[Any, int], str | None]


def is_preference_row(row: Any) -> bool:
    """Whether a parsed JSONL line is meant as a preference row (it has `input` or an output key)."""
    return isinstance(row, dict) and bool(set(row) & PREFERENCE_KEYS)


def _check_output(row: dict[str, Any], key: str, check_message: MessageCheck) -> str | None:
    output = row.get(key)
    if not isinstance(output, list) or len(output) != 1:
        return f"'{key}' must be a list of one assistant message"
    message = output[0]
    reason = check_message(message, 1)
    if reason:
        return f"'{key}': {reason}"
    if message.get("role") != "assistant":
        return f"'{key}' must be an assistant message, not {message.get('role')!r}"
    if "tool_calls" in message or "weight" in message:
        return f"'{key}': a preferred or non-preferred answer is plain text (no 'tool_calls' or 'weight')"
    if not isinstance(message.get("content"), str) or not message["content"].strip():
        return f"'{key}' has an empty answer"
    return None


def check_preference_row(row: dict[str, Any], check_message: MessageCheck) -> str | None:
    """Why a preference row is invalid, or None (`check_message` checks one chat message)."""
    extra = sorted(set(row) - PREFERENCE_KEYS)
    if extra:
        return f"the preference row has unrecognized keys {extra}"
    given = row.get("input")
    if not isinstance(given, dict) or not isinstance(given.get("messages"), list) or not given["messages"]:
        return "'input' must be an object with a non-empty 'messages' list"
    extra = sorted(set(given) - _INPUT_KEYS)
    if extra:
        return f"'input' has unrecognized keys {extra}"
    for number, message in enumerate(given["messages"], start=1):
        reason = check_message(message, number)
        if reason:
            return f"input {reason}"
    if given["messages"][-1].get("role") != "user":
        return "'input.messages' must end with a user message (the outputs answer it)"
    for key in OUTPUT_KEYS:
        reason = _check_output(row, key, check_message)
        if reason:
            return reason
    if row["preferred_output"][0]["content"] == row["non_preferred_output"][0]["content"]:
        return "'preferred_output' and 'non_preferred_output' are the same answer"
    return None
