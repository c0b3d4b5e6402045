"""HTTP routes of `/v1/chat/completions` (https://platform.openai.com/docs/api-reference/chat).

A client that goes away aborts its request (`coserve.api.routers.responding`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from coserve.api.auth import Tenant
from coserve.api.protocol.chat import ChatCompletion, ChatCompletionRequest
from coserve.api.routers.responding import respond, stream
from coserve.api.serving.chat import ChatService
from coserve.api.state import GatewayState, get_state

router = APIRouter(prefix="/v1", tags=["chat"])


def get_chat_service(state: Annotated[GatewayState, Depends(get_state)]) -> ChatService:
    """FastAPI dependency: the chat service over the app's scheduler (503 when there is none)."""
    return ChatService(state)


Service = Annotated[ChatService, Depends(get_chat_service)]


@router.post("/chat/completions", response_model=ChatCompletion)
async def create_chat_completion(tenant: Tenant, service: Service, body: ChatCompletionRequest,
                                 http: Request) -> ChatCompletion | Response:
    """A `chat.completion`, or with `stream: true` an SSE stream of `chat.completion.chunk`s."""
    submitted = await service.submit(tenant, body)

    async def abort() -> None:
        await service.abort(submitted.id)

    if body.stream:
        return stream(service.stream_events(submitted, body), abort)
    return await respond(http, service.complete(submitted, body), abort)
