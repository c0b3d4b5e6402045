"""`POST /v1/chat/completions`: the request, the `chat.completion` response and the streamed chunks.

Reference: https://platform.openai.com/docs/api-reference/chat/create. The sampling fields (and the
coserve extensions, sent by the `openai` client through `extra_body=`) are shared with
`/v1/completions`: `coserve.api.protocol.sampling`. `MAX_N` and `StreamOptions` live there.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from coserve.api.protocol.base import OpenAIBaseModel, UsageInfo, now, param_error, unknown_param_error
from coserve.api.protocol.param_support import CHAT_COMPLETIONS, CHAT_MESSAGE, EndpointParams
from coserve.api.protocol.response_format import ResponseFormat
from coserve.api.protocol.sampling import MAX_N, MAX_STOP_SEQUENCES, SamplingRequest, StreamOptions  # noqa: F401
from coserve.api.protocol.strict import RequestModel
from coserve.api.protocol.tools import (
    ChatCompletionMessageToolCall,
    ChoiceDeltaToolCall,
    ToolChoice,
    check_tool_request,
)
from coserve.api.protocol.training_tools import check_tool_calls, check_tool_flow, unknown_call_key
from coserve.contract.sampling import SamplingParams
from coserve.tools.spec import ToolSpec

MessageRole = Literal["system", "user", "assistant", "developer", "tool"]
# grammar_error (coserve's): the response_format grammar could not go on (a parser limit was hit).
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call", "grammar_error"]

MAX_TOP_LOGPROBS = 20


class ChatCompletionContentPartText(RequestModel):
    """A text part of a message's content; the only part type a text-only model accepts."""

    type: Literal["text"]
    text: str


class ChatCompletionMessageParam(RequestModel):
    """One input message. One model for every role (not a tagged union) so errors name plain params.

    `tool_calls` (assistant messages only) are checked as fine-tuning rows' are and rendered by the
    chat template; `tool` messages answer them by `tool_call_id`. The other fields OpenAI (or the official
    client's reply object, sent back as is) puts on a message are in `param_support.CHAT_MESSAGE`.
    """

    PARAMS: ClassVar[EndpointParams | None] = CHAT_MESSAGE

    role: MessageRole
    content: str | list[ChatCompletionContentPartText] | None = None
    name: str | None = None
    tool_calls: list[dict[str, object]] | None = None
    tool_call_id: str | None = None

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _drop_client_fields(cls, calls: Any) -> Any:
        # The official client's stream helper adds `index` to each call and `parsed_arguments` to its
        # function; a message it reassembled is sent back as is. They say nothing new: ignore them.
        if not isinstance(calls, list):
            return calls
        return [_without_client_fields(call) for call in calls]

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatCompletionMessageParam:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise param_error("content", f"a '{self.role}' message needs 'content'")
        if self.role == "tool" and not self.tool_call_id:
            raise param_error("tool_call_id", "a 'tool' message needs 'tool_call_id'")
        if self.tool_calls is not None and self.role != "assistant":
            raise param_error("tool_calls", f"only 'assistant' messages may have 'tool_calls', not '{self.role}'")
        return self

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM does), None as ''."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


def _without_client_fields(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    call = {key: value for key, value in call.items() if key != "index"}
    if isinstance(call.get("function"), dict):
        call["function"] = {k: v for k, v in call["function"].items() if k != "parsed_arguments"}
    return call


class ChatCompletionRequest(SamplingRequest):
    """The body of `POST /v1/chat/completions`.

    The sampling fields are `SamplingRequest`'s; what chat adds: `messages`, `logprobs` /
    `top_logprobs`, `response_format`, `tools` / `tool_choice` / `parallel_tool_calls`, and
    `max_completion_tokens`, which wins over the deprecated `max_tokens` when both are sent. What
    coserve refuses (`audio`, `functions`, ...) is listed in
    `param_support.CHAT_COMPLETIONS`: a 400 naming it. `"stream": "yes"` is a 400 (strict types).
    """

    PARAMS: ClassVar[EndpointParams | None] = CHAT_COMPLETIONS

    messages: Annotated[list[ChatCompletionMessageParam], Field(min_length=1)]
    logprobs: bool | None = False
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    tool_choice: ToolChoice | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise param_error("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        spec = check_tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)
        if spec is not None and spec.constrained and self.response_format and self.response_format.type != "text":
            raise param_error("response_format", "'response_format' cannot be combined with a 'tool_choice' "
                                                 "that forces a call: the reply is the call")
        self._check_tool_history()
        return self

    def _check_tool_history(self) -> None:
        """Earlier calls and their results fit together (the fine-tuning rows' rules)."""
        for index, message in enumerate(self.messages):
            if message.tool_calls is not None:
                unknown = unknown_call_key(message.tool_calls, f"messages[{index}].tool_calls")
                if unknown is not None:
                    raise unknown_param_error(unknown)
                problem = check_tool_calls(message.tool_calls, index + 1)
                if problem is not None:
                    raise param_error(f"messages[{index}].tool_calls", f"Invalid 'tool_calls': {problem}")
        if any(m.role == "tool" or m.tool_calls for m in self.messages):
            dumped = [m.model_dump(include={"role", "tool_calls", "tool_call_id"}) for m in self.messages]
            # An earlier call of a function this request no longer offers is history, not an error.
            problem = check_tool_flow(dumped, None, parallel=True)
            if problem is not None:
                raise param_error("messages", f"Invalid tool calls in 'messages': {problem}")

    def tool_spec(self) -> ToolSpec | None:
        """The tools the model is given and how it must use them (None without `tools`)."""
        return check_tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def requested_max_tokens(self) -> int | None:
        """The client's output limit, if any: `max_completion_tokens`, else the deprecated `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """Engine sampling parameters for this request.

        Args:
            default_max_tokens: the limit when the client sets none, normally the context length minus
                the prompt length. The serving layer checks a client limit against the context itself
                (400 `context_length_exceeded`); it is not clamped here.
        """
        requested = self.requested_max_tokens()
        return self.sampling_params(
            max_tokens=requested if requested is not None else default_max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            structured_output=self.response_format.to_structured_output() if self.response_format else None)


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


class TopLogprob(OpenAIBaseModel):
    """One of the most likely tokens at an output position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(OpenAIBaseModel):
    """The sampled token at one output position, its log probability and the top alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIBaseModel):
    """Log probabilities of a choice's content tokens."""

    content: list[ChatCompletionTokenLogprob] | None = None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionMessage(OpenAIBaseModel):
    """The generated assistant message of a non-streamed choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None


class ChatCompletionChoice(OpenAIBaseModel):
    """One of the `n` completions of a non-streamed response."""

    index: int
    message: ChatCompletionMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(OpenAIBaseModel):
    """The `chat.completion` response object."""

    id: str = Field(default_factory=_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChoiceDelta(OpenAIBaseModel):
    """What a chunk adds to a choice: the role in the first chunk, then content pieces or tool calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None


class ChatCompletionChunkChoice(OpenAIBaseModel):
    """A choice inside a streamed chunk; `finish_reason` is set only in its last chunk."""

    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    """One `chat.completion.chunk` SSE event.

    With `stream_options.include_usage` every chunk carries `usage: null` and one extra final chunk
    has `choices: []` and the usage; dump with `exclude_none=False` so `usage: null` is present.
    """

    id: str = Field(default_factory=_completion_id)
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None
