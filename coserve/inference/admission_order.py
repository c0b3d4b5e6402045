"""Which waiting request the inference scheduler admits next, and what requests cost their tenants.

The `InferencePlanner` (`planner.py`) runs requests the same way whatever the order; its
`AdmissionOrder` decides who goes next:

* `FifoOrder`: arrival order (preempted requests first again), nothing charged: offline generation.
* `VtcOrder`: FlexLLM Algorithm 4's admission across tenants: the least-counter tenant's earliest
  request (`TenantQueues`), charged `w_p` per prompt token once (a recompute after a preemption is not
  charged again: the tenant did not ask for it) and `w_q` per sampled token; and the TTFT guard: a
  request that has waited `ttft_guard_s` is admitted before every other waiting request whatever the
  counters. For a fan-out (n > 1) the guard acts for one sequence until one is admitted; the others
  wait in VTC order like separate requests (`fanouts.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from coserve.inference.fanouts import FanOuts
from coserve.inference.request import Request, RequestStatus
from coserve.inference.waiting import FifoQueue, TenantQueues, WaitingQueue
from coserve.tenancy.vtc import VirtualTokenCounter

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class AdmissionOrder(Protocol):
    """The waiting queue's order and the accounting that goes with it (module docstring)."""

    @property
    def queue(self) -> WaitingQueue:
        """The waiting requests (the scheduler appends, removes and requeues preempted ones)."""

    def next_waiting(self) -> Request | None:
        """The waiting request to admit next, or None when none waits."""

    def added(self, request: Request) -> None:
        """A valid new request is about to be queued."""

    def admitted(self, request: Request) -> None:
        """A request joined the running batch (again, after a preemption)."""

    def finished(self, request: Request) -> None:
        """A request finished (stopped, aborted, at its length limit)."""

    def withdrawn(self, request: Request) -> None:
        """A waiting request that was never admitted left this queue for another engine's."""

    def sampled(self, touched: Sequence[Request]) -> None:
        """The requests in `touched` received a token in the iteration just applied."""


class FifoOrder:
    """Arrival order, no accounting."""

    def __init__(self) -> None:
        self._queue = FifoQueue()

    @property
    def queue(self) -> FifoQueue:
        return self._queue

    def next_waiting(self) -> Request | None:
        return self._queue.head()

    def added(self, request: Request) -> None:
        pass

    def admitted(self, request: Request) -> None:
        pass

    def finished(self, request: Request) -> None:
        pass

    def withdrawn(self, request: Request) -> None:
        pass

    def sampled(self, touched: Sequence[Request]) -> None:
        pass


class VtcOrder:
    """Virtual token counter order across tenants, with the TTFT guard (module docstring).

    Args:
        vtc: the counters (shared with fine-tuning when co-serving).
        default_weight: the weight of a tenant that `vtc` does not know yet.
        ttft_guard_s: waiting time after which a request is overdue.
        on_change: called with a tenant whose sub-queue just became empty or non-empty (the owner
            reports the tenant's backlog, requests and jobs together, to `vtc`).
        input_charged: the ids of requests whose prompt was charged, when several engines share the
            counters (`shared_vtc.SharedVtc`: a re-routed request is not charged twice); None: its own.
    """

    def __init__(self, vtc: VirtualTokenCounter, default_weight: float, ttft_guard_s: float,
                 on_change: Callable[[str], None], input_charged: set[str] | None = None) -> None:
        self._vtc = vtc
        self._default_weight = default_weight
        self._guard_s = ttft_guard_s
        self._queue = TenantQueues(vtc, on_change)
        self._input_charged: set[str] = set() if input_charged is None else input_charged
        self._overdue: list[Request] = []  # this plan's overdue waiting requests, oldest last
        self._fanouts = FanOuts()  # the guard acts for one sequence of a fan-out (n > 1), not all of them

    @property
    def queue(self) -> TenantQueues:
        return self._queue

    def start_plan(self, now: float) -> None:
        """Note the requests overdue when the plan starting at `now` was begun (read once per plan)."""
        # Oldest last: overdue_waiting pops admitted (or aborted) ones off the end.
        self._overdue = self._fanouts.guarded(self._queue.arrived_by(now - self._guard_s))[::-1]

    def overdue_waiting(self) -> Request | None:
        """The oldest request still waiting that had waited past the TTFT guard when this plan
        started, else None (admitted ones are skipped)."""
        overdue = self._overdue
        while overdue and overdue[-1].status not in _WAITING:
            overdue.pop()
        return overdue[-1] if overdue else None

    def next_waiting(self) -> Request | None:
        overdue = self.overdue_waiting()
        return overdue if overdue is not None else self._queue.head()

    def added(self, request: Request) -> None:
        """Register an unknown tenant (default weight) before its request is queued."""
        self._vtc.ensure_tenant(request.tenant, self._default_weight)
        self._fanouts.added(request)

    def admitted(self, request: Request) -> None:
        if request.request_id not in self._input_charged:
            self._input_charged.add(request.request_id)
            self._vtc.charge_input(request.tenant, len(request.prompt_token_ids))
        self._fanouts.admitted(request)

    def finished(self, request: Request) -> None:
        self._input_charged.discard(request.request_id)
        self._fanouts.finished(request)

    def withdrawn(self, request: Request) -> None:
        # Not charged here (never admitted); a charge made on a lost engine stays in the shared set.
        self._fanouts.finished(request)

    def sampled(self, touched: Sequence[Request]) -> None:
        for tenant, count in Counter(r.tenant for r in touched).items():
            self._vtc.charge_output(tenant, count)
