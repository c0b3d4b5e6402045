"""`FairQueue`: whose grading goes next when tenants compete for the same workers (python grader sandboxes,
grading threads). Each tenant waits in its own first-in first-out queue; the next item is the oldest of the
tenant that has used the least grading time among those under `per_tenant` items running at once.

The grading time is counted by the project's virtual counters (`tenancy.vtc.VirtualTokenCounter`, one
second of a worker charged as one unit of work): a tenant that was idle is lifted to the others' counters
when it comes back, so idle time is not banked as credit, exactly as for inference tokens. Not thread-safe:
its owner holds its own lock around every call.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from coserve.tenancy.vtc import VirtualTokenCounter, VTCWeights

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Per-tenant queues served least-grading-time first, at most `per_tenant` running per tenant."""

    def __init__(self, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant must be >= 1, got {per_tenant}")
        self.per_tenant = per_tenant
        self._queues: dict[str, deque[T]] = {}
        self._running: dict[str, int] = {}
        self._counters = VirtualTokenCounter(VTCWeights())

    def push(self, tenant: str, item: T) -> None:
        self._counters.ensure_tenant(tenant, 1.0)
        self._counters.on_backlogged(tenant)
        self._queues.setdefault(tenant, deque()).append(item)

    def remove(self, tenant: str, item: T) -> bool:
        """Take a waiting item out (its caller gave up); False when it is not waiting."""
        queue = self._queues.get(tenant)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        self._settle(tenant)
        return True

    def waiting(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def pop(self) -> tuple[str, T] | None:
        """The next item, now counted as running for its tenant; None when no tenant under its cap waits."""
        ready = [t for t, queue in self._queues.items() if queue and self.running(t) < self.per_tenant]
        tenant = self._counters.select(ready)
        if tenant is None:
            return None
        self._running[tenant] = self.running(tenant) + 1
        return tenant, self._queues[tenant].popleft()

    def done(self, tenant: str, seconds: float) -> None:
        """A running item of `tenant` ended after `seconds` of a worker's time (charged to it)."""
        self._running[tenant] = self.running(tenant) - 1
        self._counters.charge_finetune(tenant, max(0.0, seconds))
        self._settle(tenant)

    def counter(self, tenant: str) -> float:
        """The tenant's grading seconds (lifted: see the module docstring)."""
        return self._counters.counter(tenant)

    def _settle(self, tenant: str) -> None:
        if not self._queues.get(tenant):
            self._queues.pop(tenant, None)
            if not self.running(tenant):
                self._running.pop(tenant, None)
                self._counters.on_idle(tenant)
