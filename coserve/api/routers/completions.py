"""HTTP route of `/v1/completions` (https://platform.openai.com/docs/api-reference/completions).

A client that goes away aborts every prompt of its request (`coserve.api.routers.responding`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from coserve.api.auth import Tenant
from coserve.api.protocol.completions import Completion, CompletionRequest
from coserve.api.routers.responding import respond, stream
from coserve.api.serving.completions import CompletionService
from coserve.api.state import GatewayState, get_state

router = APIRouter(prefix="/v1", tags=["completions"])


def get_completion_service(state: Annotated[GatewayState, Depends(get_state)]) -> CompletionService:
    """FastAPI dependency: the completions service over the app's scheduler (503 when there is none)."""
    return CompletionService(state)


Service = Annotated[CompletionService, Depends(get_completion_service)]


@router.post("/completions", response_model=Completion)
async def create_completion(tenant: Tenant, service: Service, body: CompletionRequest,
                            http: Request) -> Completion | Response:
    """A `text_completion`, or with `stream: true` an SSE stream of `text_completion` chunks."""
    handle = await service.submit(tenant, body)

    async def abort() -> None:
        await service.abort(handle)

    if body.stream:
        return stream(service.stream_events(handle, body), abort)
    return await respond(http, service.complete(handle, body), abort)
