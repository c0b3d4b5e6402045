"""Rendering training conversations with the chat template, tools included (issue 20 item 5).

Training rows come in OpenAI's fine-tuning format: a top-level `tools` list, assistant messages with
`tool_calls` whose `function.arguments` is a JSON *string*, and `tool` messages answering them.
Hugging Face chat templates take `arguments` as a dict (they write it with `tojson`), so
`template_messages` parses it before rendering: the model trains on the call text its template
writes, which is what it must generate when served.

A template that does not render tools or tool calls (SmolLM2's writes `role` and `content` only)
would drop the calls from the training text and train the model on empty turns; such a template is
refused (`TemplateError`) before anything is trained: `require_tool_support` probes it once per
example with tools, `require_calls_rendered` and `require_tools_rendered` check the example's own
renderings.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
from transformers.utils.chat_template_utils import render_jinja_template

from coserve.tools.call_ids import keep_id

Tools = Sequence[Mapping[str, Any]]
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError)
# The probe conversation: a tool and a call with names no real conversation uses by chance. The call's
# id has 9 letters and digits, the only ids Mistral templates take (`coserve.tools.call_ids`).
PROBE_TOOL = "coserve_probe_tool"
PROBE_ARGUMENTS = {"x": "coserve_probe_value"}
_PROBE_ARGUMENT = PROBE_ARGUMENTS["x"]
_PROBE_CALL_ID = "coserveP1"
_NO_TOOL_SUPPORT = ("the base model's chat template does not render {what}: training on this data "
                    "would drop them from the training text. Fine-tune a model whose chat template "
                    "supports tools (Qwen2.5's, Llama 3.x's and Mistral's do), or remove the tools from the "
                    "training file")


class TemplateError(ValueError):
    """The chat template cannot give an exact loss mask for this conversation."""


def content_text(message: Mapping[str, Any]) -> str:
    """A message's text: a string, or the `text` parts of an OpenAI content list, joined."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def tool_calls(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """An assistant message's tool calls (an empty list without any)."""
    return list(message.get("tool_calls") or [])


def _parsed_call(call: Mapping[str, Any], where: str, call_id: Callable[[str], str]) -> dict[str, Any]:
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: 'arguments' is not valid JSON ({exc.msg})") from None
    parsed = {**call, "function": function}
    if isinstance(call.get("id"), str):
        parsed["id"] = call_id(call["id"])
    return parsed


def template_messages(messages: Sequence[Mapping[str, Any]],
                      call_id: Callable[[str], str] = keep_id) -> list[dict[str, Any]]:
    """The messages as HF chat templates take them: tool-call arguments parsed from their JSON strings,
    and every call id (`tool_calls[j].id`, `tool_call_id`) as the template's family takes it (`call_id`,
    `ToolFamily.call_id`: Mistral's 9 characters).

    Raises:
        ValueError: an `arguments` string that is not JSON (upload validation refuses it first).
    """
    result = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [_parsed_call(call, f"message {i}, tool call {j}", call_id)
                                     for j, call in enumerate(message["tool_calls"])]
        if isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = call_id(message["tool_call_id"])
        result.append(message)
    return result


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], generation_prompt: bool,
           tools: Tools | None = None) -> str:
    """The template's text for `messages` (an empty conversation without a prompt renders to "").

    Raises:
        TemplateError: the template fails on this conversation (a jinja error, or its own
            `raise_exception`), so no training text exists for it.
    """
    tools = list(tools) if tools else None
    try:
        if messages:
            text: str = tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
            return text
        if not generation_prompt:
            return ""
        # apply_chat_template refuses an empty conversation; the generation prompt that opens a
        # conversation starting with an assistant message still exists, so render it directly.
        # render_jinja_template returns the renderings and the generation indices (mypy reads transformers as
        # Any: pyproject.toml).
        rendered, _ = render_jinja_template(
            [[]], tools=tools,
            chat_template=tokenizer.get_chat_template(), add_generation_prompt=True, **tokenizer.special_tokens_map)
        return str(rendered[0])
    except TemplateError:
        raise
    except _RENDER_ERRORS as exc:
        raise TemplateError(f"the chat template cannot render this conversation: {exc}") from exc


def probe_conversation() -> list[dict[str, Any]]:
    """A user message and an assistant message that calls `PROBE_TOOL` with `PROBE_ARGUMENTS`."""
    call = {"id": _PROBE_CALL_ID, "type": "function",
            "function": {"name": PROBE_TOOL, "arguments": dict(PROBE_ARGUMENTS)}}
    return [{"role": "user", "content": "probe"}, {"role": "assistant", "tool_calls": [call]}]


def require_tool_support(tokenizer: Any, with_tools: bool) -> None:
    """Refuse a template that does not write tool calls (and, with `with_tools`, a `tools` list).

    Raises:
        TemplateError: the probe conversation fails to render or loses the call or the tool.
    """
    probe_tools = [{"type": "function", "function": {
        "name": PROBE_TOOL, "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]
    messages = probe_conversation()
    try:
        text = render(tokenizer, messages, generation_prompt=False)
    except TemplateError as exc:
        raise TemplateError(_NO_TOOL_SUPPORT.format(what="tool calls") + f" ({exc})") from exc
    if PROBE_TOOL not in text or _PROBE_ARGUMENT not in text:
        raise TemplateError(_NO_TOOL_SUPPORT.format(what="tool calls"))
    if with_tools:
        without_call = [messages[0], {"role": "assistant", "content": "ok"}]
        if PROBE_TOOL not in render(tokenizer, without_call, False, tools=probe_tools):
            raise TemplateError(_NO_TOOL_SUPPORT.format(what="the 'tools' list"))


def require_tools_rendered(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Tools,
                           full: str) -> None:
    """Every tool's name is in the rendering, and the rendering changes without `tools`."""
    names = [tool["function"]["name"] for tool in tools]
    if any(name not in full for name in names) or render(tokenizer, messages, False) == full:
        raise TemplateError(_NO_TOOL_SUPPORT.format(what="the 'tools' list"))


def require_calls_rendered(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Tools | None,
                           upto: str, calls_start: int, turn_end: int) -> None:
    """The last message's tool calls are written in its turn (`upto[calls_start:turn_end]`): each
    function's name, and arguments that change the text when they change."""
    calls = tool_calls(messages[-1])
    turn = upto[calls_start:turn_end]
    if any(call["function"]["name"] not in turn for call in calls):
        raise TemplateError(_NO_TOOL_SUPPORT.format(what="tool calls"))
    if not any(call["function"].get("arguments") for call in calls):
        return
    emptied = [{**call, "function": {**call["function"], "arguments": {}}} for call in calls]
    if render(tokenizer, [*messages[:-1], {**messages[-1], "tool_calls": emptied}], False, tools) == upto:
        raise TemplateError(_NO_TOOL_SUPPORT.format(what="tool-call arguments"))


def require_tool_results_rendered(messages: Sequence[Mapping[str, Any]], full: str) -> None:
    """A `tool` message's content is context the model must see: refuse a template that drops it."""
    for i, message in enumerate(messages):
        if message.get("role") == "tool" and content_text(message) not in full:
            raise TemplateError(f"message {i}: the chat template does not render this tool result")
