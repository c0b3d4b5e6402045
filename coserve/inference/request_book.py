"""The requests of one engine's inference planner, by state, and what each holds: its KV blocks, its adapter's
pin and slot, its state in the engine. A request is added waiting, admitted into the running batch, preempted
back to the head of the queue (its K/V dropped: it recomputes later), withdrawn for another engine while it
was never admitted, or finished; what it holds is released when it leaves the batch, and the engine drops
its state in the next plan (`take_freed`). The planner (`planner.py`) decides who moves; this book keeps the
moves consistent. Pure Python."""

from __future__ import annotations

from collections.abc import Callable

from coserve.contract.plan import IterationPlan
from coserve.inference.adapter_slots import AdapterSlots, RunningAdapters, acquire_into
from coserve.inference.admission_order import AdmissionOrder
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.request import Request, RequestStatus


class RequestBook:
    """The requests and what they hold (module docstring).

    Args:
        kv / adapters: the engine's KV blocks and adapter slots.
        order: the admission order (told of every request's arrival, admission and end; it owns the queue).
        on_finished: called with each request that left, after what it held was released.
    """

    def __init__(self, kv: KVBlockManager, adapters: AdapterSlots, order: AdmissionOrder,
                 on_finished: Callable[[Request], None]) -> None:
        self._kv, self._adapters, self._order, self._on_finished = kv, adapters, order, on_finished
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = order.queue
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.running_adapters = RunningAdapters()
        self._in_engine: set[str] = set()  # ids the engine holds state for (sent as NewSequence)
        self._pinned: set[str] = set()  # ids holding an adapter pin
        self._freed: list[str] = []  # finished since the last plan; freed in the next one

    def add(self, request: Request) -> None:
        """Queue a request at the back.

        Raises:
            ValueError: its id is in use.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        self._order.added(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def withdraw(self, request_id: str) -> Request | None:
        """Take out a waiting request that was never admitted (no blocks, no slot, no engine state) so
        that another engine can queue it; None when there is no such request."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING or request_id in self._in_engine:
            return None
        self.waiting.remove(request)
        del self.requests[request_id]
        self._order.withdrawn(request)
        self._on_finished(request)  # it leaves this engine's watchers too
        return request

    def pin_adapter(self, request: Request, plan: IterationPlan) -> int:
        """A request being admitted pins its adapter (loaded in `plan` if need be); its slot (-1: none)."""
        if request.adapter is None:
            return -1
        self._pinned.add(request.request_id)
        return acquire_into(self._adapters, request.adapter, plan)

    def entered_engine(self, request_id: str) -> None:
        """Its `NewSequence` is in a plan: the engine holds its state from then on."""
        self._in_engine.add(request_id)

    def admitted(self, request: Request) -> None:
        """The request joined the running batch."""
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        adapter = request.adapter
        slot = self._adapters.slot_of(adapter.adapter_id) if adapter is not None else None
        self.running_adapters.admitted(request.request_id, -1 if slot is None else slot)
        self._order.admitted(request)

    def preempt(self, request: Request, plan: IterationPlan) -> None:
        """Drop a running request's K/V and requeue it first; it recomputes from scratch later."""
        self.running.remove(request)
        self.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        plan.freed.append(request.request_id)
        self._in_engine.discard(request.request_id)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """The request ends with `status`; its engine state is freed in the next plan."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        # An aborted request (a client gone, a cancelled response) frees its KV at once.
        ended = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        self.release(request, request.retain_kv_s if ended else 0.0)
        del self.requests[request.request_id]
        if request.request_id in self._in_engine:
            self._in_engine.discard(request.request_id)
            self._freed.append(request.request_id)
        self._order.finished(request)
        self._on_finished(request)

    def release(self, request: Request, retain_s: float = 0.0) -> None:
        """Give back what the request holds (its blocks, kept `retain_s` as cached ones; its adapter pin)."""
        self._kv.free(request.request_id, retain_s)
        self.running_adapters.released(request.request_id)
        if request.request_id in self._pinned:
            self._pinned.discard(request.request_id)
            if request.adapter is not None:
                self._adapters.release(request.adapter.adapter_id)

    @property
    def has_freed(self) -> bool:
        """Requests ended whose engine state the next plan must free."""
        return bool(self._freed)

    def take_freed(self) -> list[str]:
        """The requests whose engine state the next plan frees (then none until more end)."""
        freed, self._freed = self._freed, []
        return freed
