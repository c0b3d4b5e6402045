"""Responses being generated in this gateway: their live output and events, for background responses
(retrieved while running, streamed from `starting_after`, cancelled) and the streams that read them.

A `ResponseRun` is one response's generation: its `ResponseBuilder` (the response object as it grows and
every event so far) and a wake-up for readers. `ResponseRuns` keeps the background ones by id while they
run and for `KEEP_FINISHED_S` after (a stream resumed then replays the very events it missed); after that
the store answers. A tenant runs at most `MAX_BACKGROUND_PER_TENANT` background responses at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from coserve.api.protocol.base import ProtocolError
from coserve.api.serving.response_events import ResponseBuilder

KEEP_FINISHED_S = 60.0
MAX_BACKGROUND_PER_TENANT = 256


@dataclass(eq=False)
class ResponseRun:
    """One response being generated.

    Args:
        tenant: whose it is.
        builder: its output and events.
        input_items: its request's input items, as stored.
        store: whether it is stored when it ends.
    """

    tenant: str
    builder: ResponseBuilder
    input_items: list[dict[str, Any]]
    store: bool
    background: bool = False
    cancelled: bool = False
    finished_at: float | None = None
    task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> str:
        return self.builder.response.id

    def changed(self) -> None:
        """New events: wake every reader."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def finish(self, now: float) -> None:
        """The run ended at `now` (the runs' clock): its last event is out."""
        self.finished_at = now
        self.changed()

    async def events(self, starting_after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """The run's events with a `sequence_number` above `starting_after`, as they come, until its last."""
        sent = starting_after + 1
        while True:
            waiter = self._changed
            events = self.builder.events
            while sent < len(events):
                yield events[sent]
                sent += 1
            if self.finished_at is not None:
                return
            await waiter.wait()


class ResponseRuns:
    """The background responses of one gateway, by id.

    Args:
        clock: monotonic seconds (when a finished run is forgotten).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._runs: dict[str, ResponseRun] = {}
        self._clock = clock

    def admit(self, tenant: str) -> None:
        """Raise the 429 when `tenant` already runs `MAX_BACKGROUND_PER_TENANT` background responses."""
        self._forget_finished()
        running = sum(1 for run in self._runs.values() if run.tenant == tenant and run.finished_at is None)
        if running >= MAX_BACKGROUND_PER_TENANT:
            raise ProtocolError(f"You already run {running} background responses, the most this server runs "
                                "at once for one tenant; retry once one finishes.", status=429,
                                type="rate_limit_exceeded", param="background", code="rate_limit_exceeded",
                                headers={"retry-after": "1"})

    def add(self, run: ResponseRun) -> None:
        self._runs[run.id] = run

    def finished(self, run: ResponseRun) -> None:
        run.finish(self._clock())

    def get(self, tenant: str, response_id: str) -> ResponseRun | None:
        """The tenant's run `response_id` (None: unknown here, another tenant's included)."""
        self._forget_finished()
        run = self._runs.get(response_id)
        return run if run is not None and run.tenant == tenant else None

    def drop(self, response_id: str) -> None:
        self._runs.pop(response_id, None)

    def live(self) -> list[ResponseRun]:
        return [run for run in self._runs.values() if run.finished_at is None]

    def _forget_finished(self) -> None:
        cutoff = self._clock() - KEEP_FINISHED_S
        for response_id in [rid for rid, run in self._runs.items()
                            if run.finished_at is not None and run.finished_at < cutoff]:
            del self._runs[response_id]
