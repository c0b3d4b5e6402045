"""How a generation endpoint answers, whatever its objects: a JSON response that aborts its work when
the client goes away, or an SSE stream that aborts it when Starlette cancels the response.

A client that goes away aborts its request: a streamed one when Starlette cancels the response (the
generator's `finally`), a non-streamed one when the disconnect watcher sees `http.disconnect`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from coserve.api.errors import error_json

DISCONNECT_POLL_S = 0.1

T = TypeVar("T")
Abort = Callable[[], Awaitable[Any]]


async def respond(http: Request, work: Coroutine[Any, Any, T], abort: Abort) -> T | Response:
    """`await work`, or `abort()` if the client disconnects first (the answer then goes nowhere)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await abort()
                # The cancellation is delivered on the task's next turn: wait for it, or a task whose
                # abort never suspended is read while still pending (InvalidStateError, a 500).
                await asyncio.wait({task})
    if task.cancelled():
        return error_json(499, "The client closed the request.", code="client_closed_request")  # nobody reads it
    return task.result()


def stream(events: AsyncIterator[str], abort: Abort) -> StreamingResponse:
    """An SSE response of `events`; `abort()` runs when it ends before they do."""
    return StreamingResponse(_abort_on_exit(events, abort), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


async def _abort_on_exit(events: AsyncIterator[str], abort: Abort) -> AsyncIterator[str]:
    finished = False
    try:
        async for event in events:
            yield event
        finished = True
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await abort()


async def _wait_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
