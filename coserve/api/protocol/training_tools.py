"""The tool parts of a fine-tuning JSONL row, checked at upload (issue 20 item 5).

OpenAI's fine-tuning format for function calling: a row may carry a top-level `tools` list (and
`parallel_tool_calls`), assistant messages may carry `tool_calls` (their `content` then may be null
or absent), and `tool` messages answer those calls by `tool_call_id`. The shapes are the chat
completions ones:

* a tool: `{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}`,
  the name matching `^[a-zA-Z0-9_-]{1,64}$`, `parameters` a JSON Schema object, names unique, at most
  `MAX_TOOLS` of them;
* a tool call: `{"id", "type": "function", "function": {"name", "arguments"}}`, `arguments` a string
  holding a JSON object, ids unique in the row, the name one of the row's `tools` when it has any;
* a `tool` message answers a call made earlier in the row and not answered yet, and the calls of an
  assistant message are answered by the `tool` messages that directly follow it (as the chat API
  requires), or the row ends there (a row may end on the call it teaches);
* `parallel_tool_calls: false`: at most one call per assistant message.

Each check returns why the row is invalid (a phrase for the caller's "Line N: ..." error, message
numbers 1-based), or None.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from coserve.contract.training_jsonl import JsonTextError, loads_strict

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's limit on the functions of one request
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_CALL_KEYS = frozenset({"id", "type", "function"})
_CALL_FUNCTION_KEYS = frozenset({"name", "arguments"})


def _name_problem(name: Any, where: str) -> str | None:
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        return (f"{where} has an invalid name {name!r}; names are 1 to 64 letters, digits, "
                "underscores or dashes")
    return None


def _check_tool(tool: Any, where: str) -> str | None:
    if not isinstance(tool, dict):
        return f"{where} is not a JSON object"
    extra = sorted(set(tool) - _TOOL_KEYS)
    if extra:
        return f"{where} has unrecognized keys {extra}"
    if tool.get("type") != "function":
        return f"{where} needs 'type': 'function'"
    function = tool.get("function")
    if not isinstance(function, dict):
        return f"{where} needs a 'function' object"
    extra = sorted(set(function) - _FUNCTION_KEYS)
    if extra:
        return f"{where}.function has unrecognized keys {extra}"
    problem = _name_problem(function.get("name"), f"{where}.function")
    if problem:
        return problem
    if "description" in function and not isinstance(function["description"], str):
        return f"{where}.function.description must be a string"
    if "parameters" in function and not isinstance(function["parameters"], dict):
        return f"{where}.function.parameters must be a JSON Schema object"
    if "strict" in function and not isinstance(function["strict"], bool):
        return f"{where}.function.strict must be true or false"
    return None


def check_tools(tools: Any) -> str | None:
    """Why a row's `tools` value is invalid, or None."""
    if not isinstance(tools, list) or not tools:
        return "'tools' must be a non-empty list"
    if len(tools) > MAX_TOOLS:
        return f"'tools' has {len(tools)} functions; the limit is {MAX_TOOLS}"
    names: set[str] = set()
    for index, tool in enumerate(tools):
        problem = _check_tool(tool, f"tools[{index}]")
        if problem:
            return problem
        name = tool["function"]["name"]
        if name in names:
            return f"tools[{index}] repeats the function name {name!r}"
        names.add(name)
    return None


def _unknown_key(item: Any, keys: frozenset[str], function_keys: frozenset[str], where: str) -> str | None:
    if not isinstance(item, dict):
        return None
    for key in item:
        if key not in keys:
            return f"{where}.{key}"
    function = item.get("function")
    for key in function if isinstance(function, dict) else ():
        if key not in function_keys:
            return f"{where}.function.{key}"
    return None


def unknown_tool_key(tools: Any) -> str | None:
    """The path (`tools[0].function.examples`) of the first key that no tool of a chat request has, or
    None (the request's unknown-field check; `check_tools` says what else is wrong)."""
    for index, tool in enumerate(tools if isinstance(tools, list) else []):
        found = _unknown_key(tool, _TOOL_KEYS, _FUNCTION_KEYS, f"tools[{index}]")
        if found is not None:
            return found
    return None


def unknown_call_key(calls: Any, where: str) -> str | None:
    """The path (`{where}[0].function.x`) of the first key that no tool call has, or None."""
    for index, call in enumerate(calls if isinstance(calls, list) else []):
        found = _unknown_key(call, _CALL_KEYS, _CALL_FUNCTION_KEYS, f"{where}[{index}]")
        if found is not None:
            return found
    return None


def _check_call(call: Any, where: str) -> str | None:
    if not isinstance(call, dict):
        return f"{where} is not a JSON object"
    extra = sorted(set(call) - _CALL_KEYS)
    if extra:
        return f"{where} has unrecognized keys {extra}"
    if not isinstance(call.get("id"), str) or not call["id"]:
        return f"{where} needs a non-empty string 'id'"
    if call.get("type") != "function":
        return f"{where} needs 'type': 'function'"
    function = call.get("function")
    if not isinstance(function, dict):
        return f"{where} needs a 'function' object"
    extra = sorted(set(function) - _CALL_FUNCTION_KEYS)
    if extra:
        return f"{where}.function has unrecognized keys {extra}"
    problem = _name_problem(function.get("name"), f"{where}.function")
    if problem:
        return problem
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return f"{where}.function.arguments must be a string holding a JSON object"
    try:
        parsed = loads_strict(arguments)
    except JsonTextError as exc:
        return f"{where}.function.arguments: {exc}"
    if not isinstance(parsed, dict):
        return f"{where}.function.arguments must be a JSON object, not {type(parsed).__name__}"
    return None


def check_tool_calls(calls: Any, number: int) -> str | None:
    """Why the `tool_calls` of assistant message `number` (1-based) are invalid, or None."""
    if not isinstance(calls, list) or not calls:
        return f"message {number} has 'tool_calls' that is not a non-empty list"
    for index, call in enumerate(calls):
        problem = _check_call(call, f"message {number} tool_calls[{index}]")
        if problem:
            return problem
    return None


def check_tool_flow(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    parallel: bool) -> str | None:
    """Why the calls and answers of a row (each message's own shape already checked) do not fit
    together, or None (module docstring: the rules)."""
    declared = {tool["function"]["name"] for tool in tools} if tools else None
    seen: set[str] = set()
    pending: set[str] = set()  # calls of the last assistant message not answered yet
    for number, message in enumerate(messages, start=1):
        role = message["role"]
        if role == "tool":
            call_id = message["tool_call_id"]
            if call_id not in pending:
                state = "was already answered" if call_id in seen else "answers no earlier tool call"
                return f"message {number} has 'tool_call_id' {call_id!r} that {state}"
            pending.discard(call_id)
            continue
        if pending:
            return (f"message {number} comes before the tool call(s) {sorted(pending)} are answered; "
                    "'tool' messages must answer every call right after the assistant message")
        calls = message.get("tool_calls") or []  # only assistant messages may have any
        if len(calls) > 1 and not parallel:
            return f"message {number} has {len(calls)} tool calls but the row sets 'parallel_tool_calls': false"
        for index, call in enumerate(calls):
            if call["id"] in seen:
                return f"message {number} tool_calls[{index}] repeats the id {call['id']!r}"
            name = call["function"]["name"]
            if declared is not None and name not in declared:
                return f"message {number} tool_calls[{index}] calls {name!r}, which is not in the row's 'tools'"
            seen.add(call["id"])
            pending.add(call["id"])
    return None
