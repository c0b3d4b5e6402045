"""`GET`, `DELETE`, `cancel` and `input_items` of `/v1/responses/{id}`: a tenant's responses, running
(this gateway's background runs) or stored.

Another tenant's id is answered as an unknown one (404); an id of the tenant's that is no longer stored is
a 404 that says why (deleted, evicted, expired, not stored). A background response's stream is resumed
from `starting_after`: its live events while it runs and shortly after (`response_runs`), rebuilt from
the stored response later (`response_events.replay`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.responses_objects import DeletedResponse, InputItemList, ResponseObject
from coserve.api.serving.response_conversation import not_found
from coserve.api.serving.response_events import replay, sse
from coserve.api.serving.response_runs import ResponseRun, ResponseRuns
from coserve.api.state import GatewayState
from coserve.store.responses import StoredResponse


class ResponseRetrieval:
    """The tenant's responses, by id.

    Args:
        state: the gateway's store and scheduler.
        runs: the gateway's background responses.
    """

    def __init__(self, state: GatewayState, runs: ResponseRuns) -> None:
        self.state = state
        self.runs = runs

    async def _stored(self, tenant: str, response_id: str) -> StoredResponse:
        found = await anyio.to_thread.run_sync(lambda: self.state.store.responses.get(tenant, response_id))
        if not isinstance(found, StoredResponse):
            raise not_found(response_id, gone=found)
        return found

    async def get(self, tenant: str, response_id: str) -> ResponseObject:
        """The response as it is now: a running background one with its output so far."""
        run = self.runs.get(tenant, response_id)
        if run is not None:
            return run.builder.response.model_copy(deep=True)
        return ResponseObject.model_validate((await self._stored(tenant, response_id)).body)

    async def stream(self, tenant: str, response_id: str, starting_after: int) -> AsyncIterator[str]:
        """The events of a background response after `starting_after`, until its last.

        Raises:
            ProtocolError: 404 as `get`; 400 for a response that was not made in the background.
        """
        run = self.runs.get(tenant, response_id)
        events: AsyncIterator[dict[str, Any]]
        if run is not None:
            events = run.events(starting_after)
        else:
            response = ResponseObject.model_validate((await self._stored(tenant, response_id)).body)
            if not response.background:
                raise ProtocolError("Only a background response can be streamed again; retrieve it without "
                                    "'stream'.", param="stream", code="invalid_value")
            events = _listed([e for e in replay(response) if e["sequence_number"] > starting_after])
        return _as_sse(events)

    async def delete(self, tenant: str, response_id: str) -> DeletedResponse:
        """Delete the response (a running one is cancelled first: its KV is freed at once)."""
        run = self.runs.get(tenant, response_id)
        if run is not None:
            await self._cancel_run(run)
            self.runs.drop(response_id)
        deleted = await anyio.to_thread.run_sync(lambda: self.state.store.responses.delete(tenant, response_id))
        if not deleted:
            await self._stored(tenant, response_id)  # the 404 that says why
            raise not_found(response_id)
        return DeletedResponse(id=response_id)

    async def cancel(self, tenant: str, response_id: str) -> ResponseObject:
        """Cancel a background response: it stops generating at once (its KV freed), status `cancelled`.
        One that already ended is returned as it is.

        Raises:
            ProtocolError: 404 as `get`; 400 for a response not made in the background.
        """
        run = self.runs.get(tenant, response_id)
        if run is not None:
            await self._cancel_run(run)
            return run.builder.response.model_copy(deep=True)
        response = ResponseObject.model_validate((await self._stored(tenant, response_id)).body)
        if not response.background:
            raise ProtocolError("Only a background response can be cancelled.", param="response_id",
                                code="invalid_value")
        return response

    async def _cancel_run(self, run: ResponseRun) -> None:
        if run.finished_at is not None:
            return
        run.cancelled = True
        if self.state.scheduler is not None:
            await self.state.scheduler.abort(run.id)
        if run.task is not None:
            await asyncio.wait({run.task})  # it stores its final, cancelled, state

    async def input_items(self, tenant: str, response_id: str, *, after: str | None, limit: int,
                          order: Literal["asc", "desc"]) -> InputItemList:
        """A page of the response's own input items, newest first by default (OpenAI's `desc`)."""
        items = (await self._stored(tenant, response_id)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            index = next((i for i, item in enumerate(items) if item.get("id") == after), None)
            if index is None:
                raise ProtocolError(f"Invalid 'after': no input item '{after}' in this response.", param="after",
                                    code="invalid_value")
            items = items[index + 1:]
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


async def _listed(events: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for event in events:
        yield event


async def _as_sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for event in events:
        yield sse(event)
