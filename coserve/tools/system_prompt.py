"""Tools described in a system message, for chat templates that render no tools.

A template that ignores `tools` (SmolLM2's, plain ChatML) cannot show a model its functions. With
`tool_choice` `required` or a named function coserve still serves the request: the functions are
described in the system message below, in the hermes format (the wording of Qwen2.5's template, which
many small models have seen), and the grammar forces the reply into that format
(`DESCRIBED_FAMILY`), from which the calls are read. The text, with one JSON line per tool as the
request gave it (the line `For each function call, ...` is one line, cut here):

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": "get_weather", ...}}
    </tools>

    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

It is appended to the conversation's first message after a blank line when that message is a system
message, and is a new first system message otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from coserve.tools.family import HERMES

DESCRIBED_FAMILY = HERMES  # the call format the description asks for, and the grammar forces

_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
         "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
         "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
         '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tools_description(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that describes `tools` (OpenAI's shape) and the call format."""
    return _HEAD + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools) + _TAIL


def with_tools_described(messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tools' description in its system message (see the module doc)."""
    description = tools_description(tools)
    rest = [dict(message) for message in messages]
    if not rest or rest[0].get("role") != "system":
        return [{"role": "system", "content": description}, *rest]
    content = rest[0].get("content")
    if isinstance(content, list):  # text parts: one more part
        rest[0]["content"] = [*content, {"type": "text", "text": "\n\n" + description}]
    else:
        rest[0]["content"] = (content + "\n\n" if content else "") + description
    return rest
