"""HTTP routes of `/v1/chat/completions` (https://platform.openai.com/docs/api-reference/chat).

A client that goes away aborts its request: a streamed one when Starlette cancels the response (the
generator's `finally`), a non-streamed one when the disconnect watcher sees `http.disconnect`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from coserve.api.auth import Tenant
from coserve.api.errors import error_json
from coserve.api.protocol.chat import ChatCompletion, ChatCompletionRequest
from coserve.api.serving.chat import ChatService, SubmittedChat
from coserve.api.state import GatewayState, get_state

router = APIRouter(prefix="/v1", tags=["chat"])

DISCONNECT_POLL_S = 0.1


def get_chat_service(state: Annotated[GatewayState, Depends(get_state)]) -> ChatService:
    """FastAPI dependency: the chat service over the app's scheduler (503 when there is none)."""
    return ChatService(state)


Service = Annotated[ChatService, Depends(get_chat_service)]


@router.post("/chat/completions", response_model=ChatCompletion)
async def create_chat_completion(tenant: Tenant, service: Service, body: ChatCompletionRequest,
                                 http: Request) -> ChatCompletion | Response:
    """A `chat.completion`, or with `stream: true` an SSE stream of `chat.completion.chunk`s."""
    submitted = await service.submit(tenant, body)
    completion_id = submitted.id
    if body.stream:
        return StreamingResponse(_abort_on_exit(service, submitted, body), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    work = asyncio.ensure_future(service.complete(submitted, body))
    watcher = asyncio.ensure_future(_wait_disconnect(http))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with anyio.CancelScope(shield=True):
                await service.abort(completion_id)
    if work.cancelled():
        return error_json(499, "The client closed the request.", code="client_closed_request")  # nobody reads it
    return work.result()


async def _abort_on_exit(service: ChatService, submitted: SubmittedChat,
                         body: ChatCompletionRequest) -> AsyncIterator[str]:
    finished = False
    try:
        async for event in service.stream_events(submitted, body):
            yield event
        finished = True
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await service.abort(submitted.id)


async def _wait_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
