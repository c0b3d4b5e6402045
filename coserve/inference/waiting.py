"""Waiting queues of inference requests: arrival order (FCFS) or per-tenant VTC order.

A policy asks its queue for the `head` (the request to admit next), removes it once admitted, and
puts preempted requests back with `appendleft` (they were admitted before, so they go first again).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Protocol

from coserve.inference.request import Request
from coserve.tenancy.vtc import VirtualTokenCounter

_ARRIVAL = attrgetter("arrival_time")


class WaitingQueue(Protocol):
    """What InferencePlanner needs of its waiting queue (`FifoQueue`, or `TenantQueues` for VTC order)."""

    def head(self) -> Request | None:
        """The request to admit next, or None when the queue is empty."""

    def append(self, request: Request) -> None:
        """Queue a new request."""

    def appendleft(self, request: Request) -> None:
        """Queue a preempted request so that it is admitted before the others of its kind."""

    def remove(self, request: Request) -> None:
        """Take a request out (admitted or aborted); ValueError when it is not queued."""

    def __contains__(self, request: object) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FifoQueue(deque[Request]):
    """Arrival order: the head is the oldest request (after preempted ones, which go first)."""

    def head(self) -> Request | None:
        """The request at the front, or None."""
        return self[0] if self else None


class TenantQueues:
    """One FIFO sub-queue per tenant; the head is the earliest request of the least-counter tenant.

    This is the admission half of FlexLLM Algorithm 4 (lines 17-18). The counters' backlog state is
    not kept here because fine-tuning work counts too: `on_change(tenant)` is called whenever a
    tenant's sub-queue becomes empty or non-empty, and the policy reports the tenant's backlog to the
    counter from that and its jobs (before `head` is next called, as `select` requires).

    Args:
        vtc: the virtual token counters (every tenant queued here must be registered there).
        on_change: called with a tenant whose sub-queue just became empty or non-empty.
    """

    def __init__(self, vtc: VirtualTokenCounter, on_change: Callable[[str], None]) -> None:
        self._vtc = vtc
        self._on_change = on_change
        self._queues: dict[str, deque[Request]] = {}  # non-empty sub-queues only
        self._size = 0

    def head(self) -> Request | None:
        """The earliest request of the backlogged tenant with the smallest counter, or None."""
        if not self._queues:
            return None
        tenant = self._vtc.select(self._queues)
        assert tenant is not None  # candidates are non-empty
        return self._queues[tenant][0]

    def arrived_by(self, cutoff: float) -> list[Request]:
        """Queued requests that arrived at or before `cutoff`, oldest first.

        Each sub-queue is in arrival order (a tenant's requests are admitted in order, so one
        preempted back to the front arrived before the rest), so only the overdue prefix of each
        sub-queue is read.
        """
        found = []
        for queue in self._queues.values():
            for request in queue:
                if request.arrival_time > cutoff:
                    break
                found.append(request)
        found.sort(key=_ARRIVAL)
        return found

    def oldest_arrival(self) -> float | None:
        """The arrival time of the longest-waiting queued request (the head of some sub-queue), or None."""
        return min((queue[0].arrival_time for queue in self._queues.values()), default=None)

    def has_tenant(self, tenant: str) -> bool:
        """Whether the tenant has a queued request."""
        return tenant in self._queues

    def append(self, request: Request) -> None:
        """Queue a new request at the back of its tenant's sub-queue."""
        self._sub_queue(request.tenant).append(request)
        self._added(request.tenant)

    def appendleft(self, request: Request) -> None:
        """Queue a preempted request at the front of its tenant's sub-queue."""
        self._sub_queue(request.tenant).appendleft(request)
        self._added(request.tenant)

    def remove(self, request: Request) -> None:
        """Take a queued request out; ValueError when it is not queued."""
        queue = self._queues.get(request.tenant)
        if queue is None:
            raise ValueError(f"request {request.request_id!r} is not queued")
        queue.remove(request)
        self._size -= 1
        if not queue:
            del self._queues[request.tenant]
            self._on_change(request.tenant)

    def __contains__(self, request: object) -> bool:
        if not isinstance(request, Request):
            return False
        queue = self._queues.get(request.tenant)
        return queue is not None and request in queue

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        for tenant in sorted(self._queues):
            yield from self._queues[tenant]

    def _sub_queue(self, tenant: str) -> deque[Request]:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        return queue

    def _added(self, tenant: str) -> None:
        self._size += 1
        if len(self._queues[tenant]) == 1:
            self._on_change(tenant)
