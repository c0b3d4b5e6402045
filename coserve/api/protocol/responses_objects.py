"""What `/v1/responses` answers: the `response` object, its output items and usage, the input items list.

Reference: the official client's `openai.types.responses.response.Response` and its parts. A tool call is
always a `function_call` item (never text); `usage.input_tokens_details.cached_tokens` counts the prompt
tokens whose KV was already in the cache. The streamed events are `responses_events`.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import Field

from coserve.api.protocol.base import OpenAIBaseModel

ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    """An id in OpenAI's shape: `resp_`, `msg_` or `fc_` and 48 hex digits (unguessable)."""
    return f"{prefix}_{secrets.token_hex(24)}"


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] = Field(default_factory=list)


class Logprob(OpenAIBaseModel):
    """One output token's log probability and its most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] = Field(default_factory=list)
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputTextPart(OpenAIBaseModel):
    """An `output_text` part of an assistant message."""

    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Logprob] | None = None


class OutputMessage(OpenAIBaseModel):
    """An assistant `message` output item."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputTextPart] = Field(default_factory=list)


class FunctionCall(OpenAIBaseModel):
    """A `function_call` output item: the client runs it and answers with a `function_call_output`."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
        return cls(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens))


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(OpenAIBaseModel):
    """The `response` object. The request's settings are echoed back as OpenAI's are."""

    id: str
    object: Literal["response"] = "response"
    created_at: float
    status: ResponseStatus = "in_progress"
    background: bool = False
    completed_at: float | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[Annotated[OutputMessage | FunctionCall, Field(discriminator="type")]] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status not in ("queued", "in_progress")


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(OpenAIBaseModel):
    """A page of a response's input items (`GET /v1/responses/{id}/input_items`)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
