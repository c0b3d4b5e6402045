"""The items of `POST /v1/responses`'s `input`: messages, function calls, their outputs, reasoning items.

Reference: the official client's `openai.types.responses.response_input_item_param`. An item is picked by
its `type` (a message may leave it out, as `EasyInputMessageParam` does); a type coserve cannot honour
(a hosted tool's call, an image, a file) is a 400 naming `input[i].type`, never dropped. The output items
a client sends back as is (an assistant `message` with `id`, `status` and `output_text` parts carrying
`annotations` and `logprobs`, a `function_call` with its `id` and `status`) are taken: what they say
beyond the conversation is accepted and not used. A `reasoning` item is taken and left out of the prompt:
no model coserve serves reasons, so it can only hold what another server wrote.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from coserve.api.protocol.base import param_error
from coserve.api.protocol.strict import RequestModel

MAX_INPUT_ITEMS = 10_000  # a body's items; a conversation replayed with `previous_response_id` included
ItemStatus = Literal["in_progress", "completed", "incomplete"]
# The item types of OpenAI's input that belong to hosted tools or other modalities: a 400 naming them.
HOSTED_ITEM_TYPES = frozenset({
    "file_search_call", "computer_call", "computer_call_output", "web_search_call", "image_generation_call",
    "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
    "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "custom_tool_call", "custom_tool_call_output", "tool_search_call",
    "tool_search_output", "additional_tools", "compaction", "compaction_trigger", "program", "program_output",
    "configuration_update"})
_KNOWN_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_PART_TYPES = ("input_text", "output_text", "refusal")


class InputText(RequestModel):
    """A text part of a user, system or developer message (`input_text`)."""

    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # OpenAI's cache marker: accepted and not used


class OutputText(RequestModel):
    """A text part of an assistant message sent back (`output_text`); its annotations and logprobs are
    accepted and not used."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(RequestModel):
    """A refusal part of an assistant message sent back: its text is the assistant's words."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def _check_parts(data: Any, field: str) -> Any:
    """A part of another kind (an image, a file, audio) in `data[field]` is a 400 naming its `type`."""
    parts = data.get(field) if isinstance(data, dict) else None
    if isinstance(parts, list):
        for index, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in _PART_TYPES:
                raise param_error(f"{field}[{index}].type", f"content parts of type '{kind}' are not "
                                                            "supported: the models coserve serves read text only")
    return data


class MessageItem(RequestModel):
    """A message: `user`, `system` or `developer` input, or an `assistant` turn sent back."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        return _check_parts(data, "content")

    def text(self) -> str:
        """The content as one string: its parts' text joined by newlines (as chat's messages)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.refusal if isinstance(part, Refusal) else part.text for part in self.content)


class FunctionCallItem(RequestModel):
    """A call the model made, sent back: `call_id` links it to its `function_call_output`."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: None = None  # namespaced tools are refused (`tools`), so no call of one exists
    caller: dict[str, Any] | None = None  # OpenAI's programmatic callers: accepted and not used


class FunctionCallOutputItem(RequestModel):
    """What a call returned: `output` text (or `input_text` parts)."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None
    name: str | None = None
    namespace: None = None
    caller: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        return _check_parts(data, "output")

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


class ReasoningItem(RequestModel):
    """A reasoning item sent back: taken, and left out of the prompt (no served model reasons)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


def _item_kind(item: Any) -> str:
    if not isinstance(item, dict):
        return "MessageItem"  # its own type error names it
    kinds = {"function_call": "FunctionCallItem", "function_call_output": "FunctionCallOutputItem",
             "reasoning": "ReasoningItem"}
    kind = item.get("type")
    return kinds.get(kind, "MessageItem") if isinstance(kind, str) else "MessageItem"


# The tags are class names, not field names: the error's location names `input[i].content`, not the tag.
InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")] | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ReasoningItem, Tag("ReasoningItem")],
    Discriminator(_item_kind)]


def check_item_types(items: Any) -> None:
    """Before the items are parsed: a hosted tool's item, or a type nobody knows, is a 400 naming
    `input[i].type`; more than `MAX_INPUT_ITEMS` items is a 400 naming `input`. Call it in the request's
    `mode="before"` validator."""
    if not isinstance(items, list):
        return
    if len(items) > MAX_INPUT_ITEMS:
        raise param_error("input", f"at most {MAX_INPUT_ITEMS} items, got {len(items)}")
    for index, item in enumerate(items):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind is None or not isinstance(kind, str) or kind in _KNOWN_TYPES:
            continue
        if kind == "item_reference":
            raise param_error(f"input[{index}].type", "item references are not supported: send the item itself, "
                                                      "or continue the conversation with 'previous_response_id'")
        if kind in HOSTED_ITEM_TYPES:
            raise param_error(f"input[{index}].type", f"items of type '{kind}' belong to a hosted tool, which "
                                                      "this server does not run")
        raise param_error(f"input[{index}].type", f"unknown item type '{kind}'; expected one of "
                                                  f"{', '.join(_KNOWN_TYPES)}")
