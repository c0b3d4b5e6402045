"""`/v1/responses`: a request becomes the same submission a chat request becomes, its reply a `response`.

Reference: https://platform.openai.com/docs/api-reference/responses. The conversation (replayed items,
the request's own, `instructions`) is `response_conversation`'s; it goes to the scheduler as a
`ChatSubmission` through chat's `Generation` (model resolution, quotas, tools, grammars, the context
check), and the reply is read into output items and events by a `ResponseBuilder` (`response_events`),
so streamed and whole answers are one response. A response is stored when it ends (`store`, default true)
in the tenant's bounded store; a background one is stored at once (status `queued`) and runs as a task of
this gateway (`response_runs`), under the scheduler's fairness like any request. A stored response's
submission asks the scheduler to keep its conversation's KV (`KV_RETENTION_S`), so a continuation with
`previous_response_id` prefills only its new tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.responses import FunctionToolChoice, ResponseCreateRequest
from coserve.api.protocol.responses_objects import ResponseObject, ResponseUsage, new_id
from coserve.api.serving.generation import Generation
from coserve.api.serving.response_conversation import conversation
from coserve.api.serving.response_events import ResponseBuilder, sse
from coserve.api.serving.response_runs import ResponseRun, ResponseRuns
from coserve.api.serving.storage_errors import tenant_limits
from coserve.api.state import GatewayState
from coserve.contract.sampling import SamplingParams
from coserve.frontend.messages import ChatSubmission, StreamBatch
from coserve.store.responses import ResponseBounds

logger = logging.getLogger(__name__)
# How long the KV of a stored response's conversation is kept for its continuation (within the tenant's
# stored_response_ttl_s; bounded in memory by the KV cache: `coserve.inference.kv_retention`).
KV_RETENTION_S = 600.0


def _sampling(request: ResponseCreateRequest) -> SamplingParams:
    top_p = 1.0 if request.top_p is None else request.top_p
    top_k = -1
    if top_p == 0.0:  # OpenAI's top_p=0 keeps the most likely token; the engine needs top_p > 0
        top_p, top_k = 1.0, 1
    return SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature, top_p=top_p, top_k=top_k,
        seed=request.seed,
        max_tokens=request.max_output_tokens,
        logprobs=(request.top_logprobs or 0) if request.wants_logprobs else None,
        structured_output=request.text_format())


def _response_object(request: ResponseCreateRequest, response_id: str) -> ResponseObject:
    """The response as it starts: the request's settings echoed back, no output yet."""
    return ResponseObject(
        id=response_id, created_at=time.time(), status="queued" if request.background else "in_progress",
        background=bool(request.background), instructions=request.instructions,
        max_output_tokens=request.max_output_tokens, max_tool_calls=request.max_tool_calls, model=request.model,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id, store=request.stores,
        temperature=1.0 if request.temperature is None else request.temperature,
        text=request.text.model_dump(mode="json", by_alias=True, exclude_none=True) if request.text and
        request.text.format else {"format": {"type": "text"}},
        tool_choice=(request.tool_choice.model_dump(mode="json") if isinstance(request.tool_choice, FunctionToolChoice)
                     else request.tool_choice or "auto"),
        tools=[{"strict": None, "description": None, "parameters": None, **tool} for tool in request.tools or ()],
        top_logprobs=request.top_logprobs or 0, top_p=1.0 if request.top_p is None else request.top_p,
        user=request.user, safety_identifier=request.safety_identifier, prompt_cache_key=request.prompt_cache_key,
        metadata=dict(request.metadata or {}))


class ResponsesService:
    """The Responses API of one gateway.

    Args:
        state: the gateway's store, tenants and scheduler.
        runs: the gateway's background responses.
    """

    def __init__(self, state: GatewayState, runs: ResponseRuns) -> None:
        self.state = state
        self.runs = runs
        self.generation = Generation(state)

    def bounds(self, tenant: str) -> ResponseBounds:
        """The tenant's response store: its count, bytes and expiry limits (tenants file)."""
        limits = tenant_limits(self.state.tenants, tenant)
        return ResponseBounds(limits.max_stored_responses, limits.max_stored_response_bytes,
                              limits.stored_response_ttl_s)

    async def create(self, tenant: str, request: ResponseCreateRequest) -> ResponseRun:
        """Resolve the model, build the conversation and queue its submission.

        Raises:
            ProtocolError: unknown model or `previous_response_id` (404), bad items or parameters, context
                too long (400), quota (429), a background response the store cannot hold (403).
        """
        adapter = self.generation.resolve_model(tenant, request.model)
        if request.background:
            self.runs.admit(tenant)
        convo = await conversation(self.state.store, tenant, request, self.bounds(tenant).ttl_s)
        sampling = self.generation.sampling(lambda: _sampling(request))
        response = _response_object(request, new_id("resp"))
        ttl = self.bounds(tenant).ttl_s
        retain = min(KV_RETENTION_S, float(ttl if ttl is not None else KV_RETENTION_S)) if request.stores else 0.0
        admission = await self.generation.submit(ChatSubmission(
            request_id=response.id, tenant=tenant, messages=convo.messages, sampling=sampling, adapter=adapter,
            tools=request.tool_spec(), retain_kv_s=retain))
        builder = ResponseBuilder(response, admission.tool_family, request.wants_logprobs)
        run = ResponseRun(tenant, builder, convo.own, request.stores, background=bool(request.background))
        builder.start()
        if run.background:
            await self._start_background(run)
        return run

    async def _start_background(self, run: ResponseRun) -> None:
        """Store the queued response (403 when the tenant's store is full of running ones) and run it."""
        stored = await self._save(run)
        if not stored:
            await self.generation.abort(run.id)
            raise ProtocolError("Your response store is full of background responses still running, so this "
                                "one cannot be stored; wait for one to end, or cancel one.", status=403,
                                type="insufficient_quota", param="background", code="storage_quota_exceeded")
        self.runs.add(run)
        run.task = asyncio.create_task(self._run_background(run), name=f"coserve-response-{run.id}")

    async def _run_background(self, run: ResponseRun) -> None:
        try:
            async for _ in self.drive(run):
                run.changed()
        except Exception:  # noqa: BLE001 - a bug here must not stay a running response forever
            logger.exception("background response %s failed", run.id)
            run.builder.fail("The response failed on the server.")
            await self._save(run)
        finally:
            self.runs.finished(run)

    async def abort(self, run: ResponseRun) -> None:
        """The client of a response that is not in the background went away: stop generating it."""
        await self.generation.abort(run.id)

    async def drive(self, run: ResponseRun) -> AsyncIterator[None]:
        """Generate the response: feed each batch to its builder (a step per batch), then end it (the
        usage, the status) and store it when it is to be stored."""
        last, finish = StreamBatch(), None
        async for batch in self.generation.scheduler.stream(run.id):
            last = batch
            for delta in batch.deltas:
                run.builder.feed(delta)
                finish = delta.finish_reason or finish
            yield
        usage = ResponseUsage.of(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        if run.cancelled:
            run.builder.cancel(usage)
        elif last.error is not None or not last.done:
            run.builder.fail(last.error or "The stream ended early.", usage)
        else:
            run.builder.finish(finish, usage)
        await self._save(run)
        yield

    async def complete(self, run: ResponseRun) -> ResponseObject:
        """The whole response, once generated (stored when it is to be)."""
        async for _ in self.drive(run):
            pass
        return run.builder.response

    async def stream_events(self, run: ResponseRun) -> AsyncIterator[str]:
        """The SSE events of a response being generated, as they come."""
        if run.background:
            async for event in run.events():
                yield sse(event)
            return
        sent = 0
        async for _ in self._with_start(run):
            events = run.builder.events
            while sent < len(events):
                yield sse(events[sent])
                sent += 1

    async def _with_start(self, run: ResponseRun) -> AsyncIterator[None]:
        yield  # the opening events, before the first token
        async for step in self.drive(run):
            yield step

    async def _save(self, run: ResponseRun) -> bool:
        """Store the response if it is to be stored; False when it did not fit in the tenant's store."""
        if not run.store:
            return True
        body: dict[str, Any] = run.builder.response.model_dump(mode="json")
        bounds = self.bounds(run.tenant)
        result = await anyio.to_thread.run_sync(
            lambda: self.state.store.responses.put(run.tenant, body, run.input_items, bounds))
        if result == "not_stored":
            logger.info("response %s of tenant %s did not fit in its store", run.id, run.tenant)
            return False
        return True
