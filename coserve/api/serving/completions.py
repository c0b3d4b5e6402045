"""`POST /v1/completions`: one submission per prompt (no chat template), and the two answers.

Reference: https://platform.openai.com/docs/api-reference/completions. Each prompt is its own
scheduler submission with `n` children; choice `index` = prompt index x `n` + i, as OpenAI. Model
resolution, quotas and refusals are `coserve.api.serving.generation`'s, as for chat (the request counts
once against `requests_per_minute`; every prompt's tokens count against `tokens_per_minute`); if a
later prompt is refused, the earlier ones are aborted and the request fails as a whole. Usage sums the
prompts.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from coserve.api.protocol.base import ProtocolError, UsageInfo
from coserve.api.protocol.completions import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from coserve.api.serving.generation import DONE_EVENT, Generation, error_event, finish_reason, usage
from coserve.api.state import GatewayState
from coserve.frontend.messages import ChatSubmission, LogprobEntry, OutputDelta, StreamBatch


@dataclass
class CompletionHandle:
    """A submitted completions request: its id, one scheduler request per prompt, what each echoes."""

    id: str
    n: int
    request_ids: list[str] = field(default_factory=list)
    echoes: list[str] = field(default_factory=list)  # per prompt: its text with `echo`, else ""

    def index(self, prompt: int, choice: int) -> int:
        return prompt * self.n + choice


class ChoiceBuilder:
    """One choice's text and legacy logprobs, built from its deltas (`text_offset` counts the echo)."""

    def __init__(self, echo: str, want_logprobs: bool) -> None:
        self.text = echo
        self.logprobs = CompletionLogprobs() if want_logprobs else None
        self.finish: str | None = None

    def add(self, delta: OutputDelta) -> CompletionLogprobs | None:
        """Take one delta; returns the logprobs of its tokens alone (for a streamed chunk)."""
        piece = _legacy_logprobs(delta.logprobs or [], len(self.text)) if self.logprobs is not None else None
        if piece is not None:
            for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                getattr(self.logprobs, name).extend(getattr(piece, name))
        self.text += delta.text
        self.finish = delta.finish_reason or self.finish
        return piece


class CompletionService:
    """Completions for one gateway.

    Args:
        state: the gateway's store, served base models and scheduler client.
    """

    def __init__(self, state: GatewayState) -> None:
        self.generation = Generation(state)

    async def submit(self, tenant: str, request: CompletionRequest) -> CompletionHandle:
        """Resolve the model and queue one submission per prompt.

        Raises:
            ProtocolError: unknown model (404), bad parameters, `n` x prompts over the server's cap, a
                prompt the model cannot take (400), context too long (400 `context_length_exceeded`),
                quota (429 with `retry-after`).
        """
        prompts = request.prompts()
        handle = CompletionHandle(id=f"cmpl-{uuid.uuid4().hex}", n=request.n or 1)
        self.generation.check_n(handle.n * len(prompts))
        adapter = self.generation.resolve_model(tenant, request.model)
        sampling = self.generation.sampling(request.to_sampling_params)
        try:
            for k, prompt in enumerate(prompts):
                request_id = f"{handle.id}-{k}"
                admission = await self.generation.submit(ChatSubmission(
                    request_id=request_id, tenant=tenant, messages=[], sampling=sampling, adapter=adapter,
                    raw=prompt, counts_request=k == 0))
                handle.request_ids.append(request_id)
                echo = (prompt.text if prompt.text is not None else admission.prompt_text) if prompt.echo else ""
                handle.echoes.append(echo or "")
        except BaseException:
            await self.abort(handle)  # the prompts already queued: the request fails as a whole
            raise
        return handle

    async def abort(self, handle: CompletionHandle) -> None:
        for request_id in handle.request_ids:
            await self.generation.abort(request_id)

    async def complete(self, handle: CompletionHandle, request: CompletionRequest) -> Completion:
        """Wait for every choice of every prompt and build the `text_completion`.

        Raises:
            ProtocolError: 500 `server_error` when generation failed.
        """
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = 0
        for k, request_id in enumerate(handle.request_ids):
            builders = [ChoiceBuilder(handle.echoes[k], request.logprobs is not None) for _ in range(handle.n)]
            last = StreamBatch()
            async for batch in self.generation.scheduler.stream(request_id):
                last = batch
                for delta in batch.deltas:
                    builders[delta.index].add(delta)
            if last.error is not None or not last.done:
                await self.abort(handle)  # the other prompts' work is for nothing now
                raise ProtocolError(last.error or "The stream ended early.", status=500, type="server_error")
            prompt_tokens += last.prompt_tokens
            completion_tokens += last.completion_tokens
            choices += [CompletionChoice(index=handle.index(k, i), text=b.text, logprobs=b.logprobs,
                                         finish_reason=finish_reason(b.finish)) for i, b in enumerate(builders)]
        return Completion(id=handle.id, model=request.model, choices=choices,
                          usage=usage(prompt_tokens, completion_tokens))

    async def stream_events(self, handle: CompletionHandle, request: CompletionRequest) -> AsyncIterator[str]:
        """The SSE events: each echo first, then the prompts' deltas as they come (interleaved), a usage
        chunk with `include_usage`, `data: [DONE]` last (an error event instead on failure)."""
        template = Completion(id=handle.id, model=request.model, choices=[])
        builders = {(k, i): ChoiceBuilder(handle.echoes[k], request.logprobs is not None)
                    for k in range(len(handle.request_ids)) for i in range(handle.n)}
        for (k, i), builder in builders.items():
            if builder.text:
                yield _event(template, [CompletionChoice(index=handle.index(k, i), text=builder.text)])
        totals: dict[int, StreamBatch] = {}
        async for k, batch in _merged(self.generation, handle.request_ids):
            for delta in batch.deltas:
                piece = builders[k, delta.index].add(delta)
                if delta.text or piece or delta.finish_reason is not None:
                    finish = None if delta.finish_reason is None else finish_reason(delta.finish_reason)
                    yield _event(template, [CompletionChoice(index=handle.index(k, delta.index), text=delta.text,
                                                             logprobs=piece, finish_reason=finish)])
            if batch.error is not None:
                await self.abort(handle)
                yield error_event(batch.error)
                return
            if batch.done:
                totals[k] = batch
        if len(totals) < len(handle.request_ids):
            yield error_event("The stream ended early.")
            return
        if request.include_usage:
            yield _event(template, [], usage(sum(b.prompt_tokens for b in totals.values()),
                                             sum(b.completion_tokens for b in totals.values())))
        yield DONE_EVENT


async def _merged(generation: Generation, request_ids: list[str]) -> AsyncIterator[tuple[int, StreamBatch]]:
    """The batches of several requests' streams as they come, tagged with the request's position."""
    if len(request_ids) == 1:  # the common case: no tasks
        async for batch in generation.scheduler.stream(request_ids[0]):
            yield 0, batch
        return
    queue: asyncio.Queue[tuple[int, StreamBatch | None]] = asyncio.Queue()

    async def pump(k: int) -> None:
        try:
            async for batch in generation.scheduler.stream(request_ids[k]):
                await queue.put((k, batch))
        finally:
            await queue.put((k, None))  # this stream is over

    tasks = [asyncio.ensure_future(pump(k)) for k in range(len(request_ids))]
    try:
        open_streams = len(tasks)
        while open_streams:
            k, item = await queue.get()
            if item is None:
                open_streams -= 1
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()


def _legacy_logprobs(entries: list[LogprobEntry], offset: int) -> CompletionLogprobs:
    """OpenAI's legacy shape of some tokens' logprobs; the first token starts at `offset` in the text."""
    out = CompletionLogprobs()
    for entry in entries:
        out.tokens.append(entry.token)
        out.token_logprobs.append(entry.logprob)
        # The alternatives and the sampled token ("up to logprobs+1 elements", as OpenAI).
        out.top_logprobs.append({**dict(entry.top), entry.token: entry.logprob})
        out.text_offset.append(offset)
        offset += len(entry.token)
    return out


def _event(template: Completion, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
    chunk = template.model_copy(update={"choices": choices, "usage": usage})
    return f"data: {chunk.model_dump_json()}\n\n"
