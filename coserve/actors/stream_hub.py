"""`StreamHub`: the scheduler's live submissions and the token streams the gateways read from them.

A submission is registered once admitted and forgotten once its last batch is taken (or, unread, after
`UNREAD_TTL_S`). In-process, a gateway reads one request's stream (`stream`); a Ray gateway replica
reads every request it submitted in one `poll` per iteration, woken by an event shared by that
replica's submissions. Runs on the scheduler's event loop only, so nothing here locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from coserve.actors.streams import SubmissionState
from coserve.contract.messages import TokenBatch

# A finished submission whose stream nobody read is dropped after this long.
UNREAD_TTL_S = 60.0


class StreamHub:
    """Request id -> its `SubmissionState`, indexed by the gateway replica that submitted it.

    Args:
        clock: monotonic seconds (for the unread TTL).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._subs: dict[str, SubmissionState] = {}
        self._by_origin: dict[str, set[str]] = {}  # gateway replica -> its live request ids
        self._origin_events: dict[str, asyncio.Event] = {}
        self._clock = clock

    def notifier(self, origin: str) -> asyncio.Event | None:
        """The event a submission from `origin` sets on each change (None in-process: no poller)."""
        return self._origin_events.setdefault(origin, asyncio.Event()) if origin else None

    def add(self, request_id: str, state: SubmissionState) -> None:
        """Register an admitted submission."""
        self._subs[request_id] = state
        if state.origin:
            self._by_origin.setdefault(state.origin, set()).add(request_id)

    def get(self, request_id: str) -> SubmissionState | None:
        """The registered submission `request_id` (None when unknown or forgotten)."""
        return self._subs.get(request_id)

    def live(self) -> list[SubmissionState]:
        """Every registered submission not yet done."""
        return [state for state in self._subs.values() if not state.done]

    async def stream(self, request_id: str) -> AsyncIterator[TokenBatch]:
        """The request's output, batch by batch, until a batch with `done`."""
        state = self._subs.get(request_id)
        if state is None:
            yield TokenBatch(done=True, error=f"unknown request {request_id!r}")
            return
        while True:
            await state.changed.wait()
            batch = self._take(request_id, state)
            yield batch
            if batch.done:
                return

    async def poll(self, origin: str, timeout_s: float) -> dict[str, TokenBatch]:
        """The pending batches of every request `origin` submitted; waits up to `timeout_s` for one,
        returns {} when none came."""
        event = self._origin_events.setdefault(origin, asyncio.Event())
        ready = self._ready(origin)
        if not ready:
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                return {}
            ready = self._ready(origin)
        return {request_id: self._take(request_id, self._subs[request_id]) for request_id in ready}

    def forget(self, request_id: str) -> SubmissionState | None:
        """Unregister a submission; returns it (None when unknown)."""
        state = self._subs.pop(request_id, None)
        if state is not None and state.origin:
            ids = self._by_origin.get(state.origin)
            if ids is not None:
                ids.discard(request_id)
        return state

    def drop_unread(self) -> None:
        """Forget finished submissions nobody read for `UNREAD_TTL_S` (their client left before the
        response started)."""
        now = self._clock()
        stale = [rid for rid, state in self._subs.items()
                 if state.closed_at is not None and now - state.closed_at > UNREAD_TTL_S]
        for request_id in stale:
            self.forget(request_id)

    def _ready(self, origin: str) -> list[str]:
        ids = self._by_origin.get(origin, ())
        return [rid for rid in ids if (state := self._subs.get(rid)) is not None and state.changed.is_set()]

    def _take(self, request_id: str, state: SubmissionState) -> TokenBatch:
        batch = state.take()
        if batch.done:
            self.forget(request_id)
        return batch
