"""`FairSlots`: the python grader sandboxes one runner may have at once, shared fairly between tenants.

A tenant holds at most `per_tenant` slots at once (by default all but one, so a second tenant always finds
room soon), and a freed slot goes to the waiting tenant that has used the least sandbox time
(`fair_queue.FairQueue`), not to whoever asked first. A caller waits on a thread (`acquire`) or on the
event loop (`acquire_async`, which holds no thread while it waits), for a bounded time: past it, or when
the tenant already has `max_waiting` callers waiting, `GradersBusy`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coserve.graders.fair_queue import FairQueue


class GradersBusy(RuntimeError):
    """No python grader slot came free in time for this tenant."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One slot held by `tenant`: `slot` in 0..slots-1 (the sandbox's uid is derived from it)."""

    tenant: str
    slot: int
    started: float = field(default_factory=time.monotonic)


@dataclass(eq=False, slots=True)
class _Waiter:
    notify: Callable[[], None]
    lease: Lease | None = None


class FairSlots:
    """`slots` slots shared between tenants (module docstring)."""

    def __init__(self, slots: int, per_tenant: int | None = None, max_waiting: int = 16) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._queue: FairQueue[_Waiter] = FairQueue(per_tenant or max(1, slots - 1))
        self._max_waiting = max_waiting
        self._lock = threading.Lock()

    @property
    def per_tenant(self) -> int:
        return self._queue.per_tenant

    def acquire(self, tenant: str, timeout: float | None = None) -> Lease:
        """A slot for `tenant`, waiting on this thread at most `timeout` seconds (None: as long as it takes)."""
        granted = threading.Event()
        waiter = self._enqueue(tenant, granted.set)
        if granted.wait(timeout):
            assert waiter.lease is not None
            return waiter.lease
        return self._give_up(tenant, waiter)

    async def acquire_async(self, tenant: str, timeout: float) -> Lease:
        """A slot for `tenant`, waiting on the event loop at most `timeout` seconds."""
        loop = asyncio.get_running_loop()
        granted: asyncio.Future[None] = loop.create_future()

        def grant() -> None:
            if not granted.done():
                granted.set_result(None)

        def notify() -> None:
            loop.call_soon_threadsafe(grant)

        waiter = self._enqueue(tenant, notify)
        try:
            await asyncio.wait_for(asyncio.shield(granted), timeout)
        except TimeoutError:
            return self._give_up(tenant, waiter)
        except asyncio.CancelledError:  # the client went away: hand back what it may have been given
            with self._lock:
                if not self._queue.remove(tenant, waiter) and waiter.lease is not None:
                    self._release(waiter.lease)
            raise
        assert waiter.lease is not None
        return waiter.lease

    def release(self, lease: Lease) -> None:
        """Give the slot back; its time is charged to its tenant."""
        with self._lock:
            self._release(lease)

    def held(self, tenant: str) -> int:
        """Slots `tenant` holds now."""
        with self._lock:
            return self._queue.running(tenant)

    def _enqueue(self, tenant: str, notify: Callable[[], None]) -> _Waiter:
        waiter = _Waiter(notify)
        with self._lock:
            if self._queue.waiting(tenant) >= self._max_waiting:
                raise GradersBusy(f"{self._max_waiting} python graders of this tenant are already waiting for "
                                  "a slot")
            self._queue.push(tenant, waiter)
            self._dispatch()
        return waiter

    def _give_up(self, tenant: str, waiter: _Waiter) -> Lease:
        with self._lock:
            if waiter.lease is not None:  # granted just as the wait ended
                return waiter.lease
            self._queue.remove(tenant, waiter)
        raise GradersBusy(f"all {self.slots} python grader slots stayed busy (this tenant may hold "
                          f"{self.per_tenant} at once)")

    def _release(self, lease: Lease) -> None:
        self._queue.done(lease.tenant, time.monotonic() - lease.started)
        self._free.append(lease.slot)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._free:
            picked = self._queue.pop()
            if picked is None:
                return
            tenant, waiter = picked
            waiter.lease = Lease(tenant, self._free.pop())
            waiter.notify()
