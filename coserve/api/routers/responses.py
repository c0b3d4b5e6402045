"""HTTP routes of `/v1/responses` (https://platform.openai.com/docs/api-reference/responses).

A client that goes away aborts its response (`coserve.api.routers.responding`), unless it runs in the
background: that one runs on, to be retrieved, streamed again or cancelled.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse

from coserve.api.auth import Tenant
from coserve.api.protocol.responses import ResponseCreateRequest
from coserve.api.protocol.responses_objects import DeletedResponse, InputItemList, ResponseObject
from coserve.api.routers.responding import respond, stream
from coserve.api.serving.response_retrieval import ResponseRetrieval
from coserve.api.serving.response_runs import ResponseRuns
from coserve.api.serving.responses import ResponsesService
from coserve.api.state import GatewayState, get_state

router = APIRouter(prefix="/v1/responses", tags=["responses"])
MAX_ITEMS_PAGE = 100  # OpenAI's bound on `limit` for input items
Includable = Literal["message.output_text.logprobs", "reasoning.encrypted_content"]


def get_runs(http: Request) -> ResponseRuns:
    """FastAPI dependency: the app's background responses (`build_app` keeps them)."""
    runs: ResponseRuns = http.app.state.response_runs
    return runs


State = Annotated[GatewayState, Depends(get_state)]
Runs = Annotated[ResponseRuns, Depends(get_runs)]


def _events(events: Any) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})


@router.post("", response_model=ResponseObject)
async def create_response(tenant: Tenant, state: State, runs: Runs, body: ResponseCreateRequest,
                          http: Request) -> ResponseObject | Response:
    """A `response`; with `stream: true` its events (SSE); with `background: true` at once, queued."""
    service = ResponsesService(state, runs)
    run = await service.create(tenant, body)
    if run.background:
        return _events(service.stream_events(run)) if body.stream else run.builder.response

    async def abort() -> None:
        await service.abort(run)

    if body.stream:
        return stream(service.stream_events(run), abort)
    return await respond(http, service.complete(run), abort)


@router.get("/{response_id}", response_model=ResponseObject)
async def retrieve_response(tenant: Tenant, state: State, runs: Runs, response_id: str,
                            stream: Annotated[bool, Query()] = False,
                            starting_after: Annotated[int, Query(ge=-1)] = -1,
                            include: Annotated[list[Includable] | None, Query()] = None,
                            include_obfuscation: Annotated[bool | None, Query()] = None) -> ResponseObject | Response:
    """The response (running or stored); a background one's events with `stream=true`, from
    `starting_after` on."""
    del include, include_obfuscation  # logprobs are kept with the output they belong to
    retrieval = ResponseRetrieval(state, runs)
    if stream:
        return _events(await retrieval.stream(tenant, response_id, starting_after))
    return await retrieval.get(tenant, response_id)


@router.delete("/{response_id}", response_model=DeletedResponse)
async def delete_response(tenant: Tenant, state: State, runs: Runs, response_id: str) -> DeletedResponse:
    """Delete the response (a running one is cancelled first)."""
    return await ResponseRetrieval(state, runs).delete(tenant, response_id)


@router.post("/{response_id}/cancel", response_model=ResponseObject)
async def cancel_response(tenant: Tenant, state: State, runs: Runs, response_id: str) -> ResponseObject:
    """Cancel a background response: it stops at once and frees its KV."""
    return await ResponseRetrieval(state, runs).cancel(tenant, response_id)


@router.get("/{response_id}/input_items", response_model=InputItemList)
async def list_input_items(tenant: Tenant, state: State, runs: Runs, response_id: str,
                           after: Annotated[str | None, Query()] = None,
                           limit: Annotated[int, Query(ge=1, le=MAX_ITEMS_PAGE)] = 20,
                           order: Annotated[Literal["asc", "desc"], Query()] = "desc",
                           include: Annotated[list[Includable] | None, Query()] = None) -> InputItemList:
    """A page of the response's own input items."""
    del include
    return await ResponseRetrieval(state, runs).input_items(tenant, response_id, after=after, limit=limit,
                                                             order=order)
