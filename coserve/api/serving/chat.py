"""`POST /v1/chat/completions`: the submission to the scheduler and the two answers.

Reference: https://platform.openai.com/docs/api-reference/chat. Model resolution, quotas and the
scheduler's refusals are `coserve.api.serving.generation`'s, shared with `/v1/completions`.
A failure after a stream has started is sent as an error event, then the stream closes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from coserve.api.protocol.base import ProtocolError, UsageInfo
from coserve.api.protocol.chat import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    ChatCompletionTokenLogprob,
    ChoiceDelta,
    ChoiceLogprobs,
    TopLogprob,
)
from coserve.api.serving.generation import DONE_EVENT, Generation, batch_usage, error_event, finish_reason
from coserve.api.serving.tool_output import ToolStream, finish_with_calls, tool_message
from coserve.api.state import GatewayState
from coserve.frontend.messages import ChatSubmission, LogprobEntry, OutputDelta, StreamBatch
from coserve.tools.family import ToolFamily


@dataclass(frozen=True, slots=True)
class SubmittedChat:
    """A queued completion: its id, and the tool-call format its replies are read with (None: plain text)."""

    id: str
    tool_family: ToolFamily | None = None


class ChatService:
    """Chat completions for one gateway.

    Args:
        state: the gateway's store, served base models and scheduler client.
    """

    def __init__(self, state: GatewayState) -> None:
        self.generation = Generation(state)

    async def submit(self, tenant: str, request: ChatCompletionRequest) -> SubmittedChat:
        """Resolve the model, build the submission and queue it.

        Raises:
            ProtocolError: unknown model (404), bad parameters or `n` over the server's cap (400),
                context too long (400 `context_length_exceeded`), quota (429 with `retry-after`).
        """
        self.generation.check_n(request.n or 1)
        adapter = self.generation.resolve_model(tenant, request.model)
        sampling = self.generation.sampling(lambda: request.to_sampling_params(default_max_tokens=None))
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        messages = [_message_dict(m) for m in request.messages]
        admission = await self.generation.submit(ChatSubmission(
            request_id=completion_id, tenant=tenant, messages=messages, sampling=sampling, adapter=adapter,
            tools=request.tool_spec()))
        return SubmittedChat(completion_id, admission.tool_family)

    async def abort(self, completion_id: str) -> None:
        await self.generation.abort(completion_id)

    async def complete(self, submitted: SubmittedChat, request: ChatCompletionRequest) -> ChatCompletion:
        """Wait for every choice and build the `chat.completion` (tool calls read out of each reply
        when the request has tools).

        Raises:
            ProtocolError: 500 `server_error` when generation failed.
        """
        n = request.n or 1
        texts = [""] * n
        logprobs: list[list[LogprobEntry] | None] = [[] if request.logprobs else None for _ in range(n)]
        finish: list[str | None] = [None] * n
        last = StreamBatch()
        completion_id = submitted.id
        async for batch in self.generation.scheduler.stream(completion_id):
            last = batch
            for delta in batch.deltas:
                texts[delta.index] += delta.text
                entries = logprobs[delta.index]
                if delta.logprobs is not None and entries is not None:
                    entries.extend(delta.logprobs)
                finish[delta.index] = delta.finish_reason or finish[delta.index]
        if last.error is not None or not last.done:
            raise ProtocolError(last.error or "The stream ended early.", status=500, type="server_error")
        family = submitted.tool_family
        messages = [ChatCompletionMessage(content=text) if family is None else tool_message(text, family)
                    for text in texts]
        choices = [ChatCompletionChoice(index=i, message=messages[i],
                                        finish_reason=finish_with_calls(finish_reason(finish[i]),
                                                                        bool(messages[i].tool_calls)),
                                        logprobs=_choice_logprobs(logprobs[i]))
                   for i in range(n)]
        return ChatCompletion(id=completion_id, model=request.model, choices=choices, usage=batch_usage(last))

    async def stream_events(self, submitted: SubmittedChat, request: ChatCompletionRequest) -> AsyncIterator[str]:
        """The SSE events of a streamed completion, `data: [DONE]` last (an error event instead on failure)."""
        completion_id = submitted.id
        chunk = ChatCompletionChunk(id=completion_id, model=request.model, choices=[])
        tools = None if submitted.tool_family is None else ToolStream(submitted.tool_family, request.n or 1)
        first = ChoiceDelta(role="assistant", content="" if tools is None else None)  # as OpenAI's streams
        for index in range(request.n or 1):
            yield _event(chunk, [ChatCompletionChunkChoice(index=index, delta=first)])
        async for batch in self.generation.scheduler.stream(completion_id):
            for delta in batch.deltas:
                if tools is not None:
                    finish = None if delta.finish_reason is None else finish_reason(delta.finish_reason)
                    logprobs = _choice_logprobs(delta.logprobs) if delta.logprobs else None
                    for piece in tools.choices(delta, logprobs, finish):
                        yield _event(chunk, [piece])
                    continue
                choice = _chunk_choice(delta)
                if choice is not None:
                    yield _event(chunk, [choice])
            if batch.error is not None:
                yield error_event(batch.error)
                return
            if batch.done:
                if request.include_usage:
                    yield _event(chunk, [], usage=batch_usage(batch))
                yield DONE_EVENT
                return
        yield error_event("The stream ended early.")


def _message_dict(message: ChatCompletionMessageParam) -> dict[str, Any]:
    """The message as the chat template reads it: text parts joined, nothing unset."""
    data = message.model_dump(exclude_none=True)
    data["content"] = message.text()
    return data


def _token_logprob(entry: LogprobEntry) -> ChatCompletionTokenLogprob:
    return ChatCompletionTokenLogprob(
        token=entry.token, logprob=entry.logprob, bytes=list(entry.token.encode("utf-8")),
        top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in entry.top])


def _choice_logprobs(entries: list[LogprobEntry] | None) -> ChoiceLogprobs | None:
    if entries is None:
        return None
    return ChoiceLogprobs(content=[_token_logprob(e) for e in entries])


def _chunk_choice(delta: OutputDelta) -> ChatCompletionChunkChoice | None:
    if not delta.text and not delta.logprobs and delta.finish_reason is None:
        return None
    return ChatCompletionChunkChoice(
        index=delta.index, delta=ChoiceDelta(content=delta.text or None),
        logprobs=_choice_logprobs(delta.logprobs) if delta.logprobs else None,
        finish_reason=None if delta.finish_reason is None else finish_reason(delta.finish_reason))


def _event(template: ChatCompletionChunk, choices: list[ChatCompletionChunkChoice],
           usage: UsageInfo | None = None) -> str:
    chunk = template.model_copy(update={"choices": choices, "usage": usage})
    return f"data: {chunk.model_dump_json()}\n\n"
