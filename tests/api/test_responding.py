"""`respond`: a client that goes away before the answer is ready gets its work cancelled and aborted, and
the answer is the 499 nobody reads, never a server error, even when the abort returns at once."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from coserve.api.routers.responding import respond


def test_a_disconnect_cancels_the_work_and_aborts_it() -> None:
    async def main() -> tuple[object, list[str]]:
        async def receive() -> dict:
            return {"type": "http.disconnect"}  # the client is gone at once

        http = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
        calls: list[str] = []

        async def work() -> str:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                calls.append("cancelled")
                raise
            return "answer"

        async def abort() -> None:  # returns without suspending, as an in-process scheduler's does
            calls.append("aborted")

        return await respond(http, work(), abort), calls

    response, calls = asyncio.run(main())
    assert response.status_code == 499 and calls == ["aborted", "cancelled"]
