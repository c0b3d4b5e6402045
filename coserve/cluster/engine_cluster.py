"""`EngineCluster`: several engines under one scheduler's decisions.

Each engine keeps its own KV blocks, adapter slots, latency model and iteration loop (an
`EngineMember`: one `CoServingPolicy` and one `EngineCore`, one plan in flight). What is central:

* **one set of virtual token counters** (`shared_vtc`): every policy charges input, output and
  fine-tuning tokens to the same counters and reports backlog over all engines, so a tenant's fair
  share is of the whole machine, and the jobs of all engines are chosen by the same counters;
* **routing** (`routing`): a new request goes to the least loaded engine, with affinity for the one
  that holds its adapter and the one that holds its prefix (or its fan-out's siblings); a fine-tuned
  adapter's requests go only where its files are (`adapter_catalog`; every engine on shared storage);
* **jobs** (`jobs`: `ClusterJobs`): placed on one engine by memory and load, their checkpoints published to
  every engine;
* **late binding** (`work_stealing`): an engine with free batch slots takes waiting requests another
  engine would keep waiting, when their tenant is ahead in the counters (or overdue), so a tenant's
  service does not depend on where it was routed;
* **failover** (`engine_lost`, `failover`): a lost engine's requests without a token are re-routed,
  the others are handed back to end their streams, its jobs resume elsewhere from their checkpoints.

Driving it: an in-process driver calls `step(engine_id, executor)` per engine; an engine in another
process is driven with the two halves, `next_plan(engine_id)` and `apply(engine_id, result)` (each
engine's `exchange` gets its own plan). Not thread-safe: like the SchedulerActor's event loop, one
thread decides at a time (threaded drivers hold a lock around these calls, never around `Engine.step`).
With one engine it plans exactly as that engine's policy alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from coserve.cluster.adapter_catalog import AdapterCatalog
from coserve.cluster.engine_core import Step
from coserve.cluster.failover import Failover, reset_for_reroute, split_requests
from coserve.cluster.fault_isolation import PieceKind, plan_pieces
from coserve.cluster.jobs import ClusterJobs, RolloutService
from coserve.cluster.member import EngineMember
from coserve.cluster.routing import RouteChoice, RoutingWeights, route
from coserve.cluster.work_stealing import can_steal, plan_steals
from coserve.contract.engine import EngineFailure, StepExecutor
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.inference.request import Request, RequestStatus
from coserve.planner.policy import CoServingPolicy
from coserve.tenancy.shared_vtc import SharedVtc
from coserve.tenancy.vtc import VirtualTokenCounter, VTCWeights

# Builds an engine's policy with the cluster's shared counters (e.g. `share_kinds.build_policy(...,
# shared=shared)` over that engine's layout).
PolicyBuilder = Callable[[SharedVtc], CoServingPolicy]


class NoEngine(RuntimeError):
    """No engine is running to take a new request (the server answers 503)."""


class EngineCluster:
    """Several engines, one scheduler's decisions (module docstring).

    Args:
        weights: token costs of the shared counters (each policy's `CoServingConfig.vtc` must equal them).
        tenant_weights: tenant -> share under contention.
        routing: how the router trades load for affinity.
        shared_storage: every engine reads the same files (published adapters are everywhere at once).
        default_tenant_weight: the weight of a tenant met first in a job.
    """

    def __init__(self, weights: VTCWeights = VTCWeights(), tenant_weights: Mapping[str, float] | None = None,
                 *, routing: RoutingWeights = RoutingWeights(), shared_storage: bool = True,
                 default_tenant_weight: float = 1.0) -> None:
        self._vtc = VirtualTokenCounter(weights, tenant_weights)
        self.shared = SharedVtc(self._vtc, self.has_backlog)
        self._routing = routing
        self._members: dict[str, EngineMember] = {}
        self.catalog = AdapterCatalog(shared_storage)
        self.jobs = ClusterJobs(self._members, self._vtc, self.catalog,
                                RolloutService(self._submit_pinned, self.abort), default_tenant_weight)
        self._owner: dict[str, str] = {}  # unfinished request id -> its engine
        self._pinned: set[str] = set()  # unfinished requests that only their engine may run (rollouts)
        self._held: dict[str, Request] = {}  # re-routable requests of lost engines, no engine left
        self.last_route: RouteChoice | None = None  # the router's last answer (for metrics and tests)
        self.steals = 0  # requests taken over by another engine before admission (`work_stealing`)

    # ------------------------------------------------------------------------------ engines

    def add_engine(self, engine_id: str, build: PolicyBuilder) -> EngineMember:
        """Add an engine (a new one, or one restarted after `engine_lost`) with the policy `build` makes
        over the shared counters; held requests and waiting jobs are placed again.

        Raises:
            ValueError: the id is in use, or the policy does not count with `shared`.
        """
        if engine_id in self._members:
            raise ValueError(f"engine {engine_id!r} is already part of the cluster")
        policy = build(self.shared)
        if policy.vtc is not self._vtc:
            raise ValueError(f"engine {engine_id!r}: its policy keeps counters of its own; build it with "
                             "the cluster's SharedVtc")
        member = EngineMember(engine_id, policy)
        self._members[engine_id] = member
        self.catalog.add_engine(engine_id)
        held, self._held = list(self._held.values()), {}
        for request in held:
            self._route_and_add(request)
        self.jobs.place_waiting()
        return member

    def engine_lost(self, engine_id: str) -> Failover:
        """The engine died: its plan in flight is gone; re-route, strand and move its work (`failover`).

        Raises:
            ValueError: unknown engine.
        """
        member = self._members.pop(engine_id, None)
        if member is None:
            raise ValueError(f"unknown engine {engine_id!r}")
        self.catalog.remove_engine(engine_id)
        failover = Failover(engine_id)
        tenants = {r.tenant for r in member.requests.values()} | {j.tenant for j in member.jobs.values()}
        failover.jobs = self.jobs.engine_lost(member)
        pinned = {rid for rid in member.requests if rid in self._pinned}
        for request_id in pinned:  # rollouts of the engine's jobs, which start over from a checkpoint
            member.requests[request_id].status = RequestStatus.FINISHED_ABORTED
            self._pinned.discard(request_id)
            del self._owner[request_id]
            self.shared.input_charged.discard(request_id)
        reroutable, failover.stranded = split_requests(
            r for r in member.requests.values() if r.request_id not in pinned)
        for request in [*reroutable, *failover.stranded]:
            del self._owner[request.request_id]
        for request in failover.stranded:
            self.shared.input_charged.discard(request.request_id)
        for request in reroutable:
            reset_for_reroute(request)
            if not self._members:
                self._held[request.request_id] = request
                failover.waiting.append(request.request_id)
                continue
            try:
                failover.rerouted[request.request_id] = self._route_and_add(request)
            except ValueError:  # no engine left can take it (a longer context than theirs)
                self.shared.input_charged.discard(request.request_id)
                failover.stranded.append(request)
        for tenant in sorted(tenants):  # the lost engine's backlog is gone from the counters' Q
            if self.has_backlog(tenant):
                self._vtc.on_backlogged(tenant)
            else:
                self._vtc.on_idle(tenant)
        return failover

    @property
    def engines(self) -> tuple[str, ...]:
        """Live engines, in the order they joined."""
        return tuple(self._members)

    def member(self, engine_id: str) -> EngineMember:
        """The engine's member (its policy, loop and load). Raises KeyError when unknown."""
        return self._members[engine_id]

    @property
    def vtc(self) -> VirtualTokenCounter:
        """The counters every engine's policy shares."""
        return self._vtc

    def has_backlog(self, tenant: str) -> bool:
        """Whether the tenant has a queued request or a runnable job on any engine."""
        return any(m.policy.has_backlog(tenant) for m in self._members.values())

    # ------------------------------------------------------------------------------ requests

    def submit(self, request: Request) -> str:
        """Route a new request to an engine and queue it there; returns the engine.

        Raises:
            NoEngine: no engine is running.
            ValueError: a duplicate id, or as `CoServingPolicy.add_request` (nothing is queued).
        """
        if request.request_id in self._owner or request.request_id in self._held:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if not self._members:
            raise NoEngine("no engine is running")
        return self._route_and_add(request)

    def _submit_pinned(self, engine_id: str, request: Request) -> None:
        """Queue a request on this engine only: never routed, stolen or moved elsewhere (a rollout of a
        job's adapter being trained, which only this engine holds).

        Raises:
            ValueError: as `submit`.
        """
        if request.request_id in self._owner or request.request_id in self._held:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        self._members[engine_id].add(request, pinned=True)
        self._owner[request.request_id] = engine_id
        self._pinned.add(request.request_id)

    def _route_and_add(self, request: Request) -> str:
        candidates = [m for m in self._members.values() if m.fits(request)] or list(self._members.values())
        if request.adapter is not None:
            allowed = self.catalog.engines_for(request.adapter.path)
            if allowed is not None:
                candidates = [m for m in candidates if m.engine_id in allowed] or candidates
        choice = route(request, candidates, self._routing)
        self._members[choice.engine_id].add(request)
        self._owner[request.request_id] = choice.engine_id
        self.last_route = choice
        return choice.engine_id

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """Finish a request now, wherever it is; False when unknown or finished."""
        held = self._held.pop(request_id, None)
        if held is not None:
            held.status = status
            self.shared.input_charged.discard(request_id)
            return True
        engine = self._owner.get(request_id)
        if engine is None:
            return False
        member = self._members[engine]
        request = member.requests[request_id]
        if not member.policy.abort(request_id, status):
            return False
        member.forget(request)
        del self._owner[request_id]
        self._pinned.discard(request_id)
        return True

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id (queued, running or held), or None."""
        engine = self._owner.get(request_id)
        if engine is not None:
            return self._members[engine].requests.get(request_id)
        return self._held.get(request_id)

    def release_held(self) -> list[Request]:
        """Give up the requests held for an engine to join (the caller ends them): what a server does when
        its last engine is lost, rather than keep its clients waiting on a restart."""
        held, self._held = list(self._held.values()), {}
        for request in held:
            self.shared.input_charged.discard(request.request_id)
        return held

    def engine_of(self, request_id: str) -> str | None:
        """The engine an unfinished request is on; None when held (no engine) or unknown."""
        return self._owner.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._owner or self._held)

    @property
    def num_held(self) -> int:
        """Re-routable requests of lost engines waiting for an engine to join."""
        return len(self._held)

    # ---------------------------------------------------------------------------- iterations

    def has_work(self, engine_id: str) -> bool:
        """Whether the engine's policy has work, or the engine could take waiting work from another
        (`work_stealing`): what a driver asks before it lets an engine idle."""
        member = self._members[engine_id]
        return member.core.has_work() or (len(self._members) > 1
                                          and can_steal(member, self._members.values()))

    def next_plan(self, engine_id: str) -> IterationPlan | None:
        """The engine's next plan, kept in flight until `apply` (`EngineCore.next_plan`); first, with
        free batch slots, it takes waiting requests other engines would keep waiting (`work_stealing`)."""
        member = self._members[engine_id]
        self._steal_for(member)
        self.jobs.before_plan(member)
        plan = member.core.next_plan()
        if plan is None:
            self.jobs.settle(member)
        else:
            member.sent(plan)
        return plan

    def in_flight(self, engine_id: str) -> IterationPlan | None:
        return self._members[engine_id].core.in_flight

    def apply(self, engine_id: str, result: IterationResult | EngineFailure) -> Step | None:
        """Apply the engine's answer to its plan in flight (`EngineCore.apply`), then the cluster's
        bookkeeping: finished requests, requests that failed alone (aborted here: the caller ends their
        streams with `step.result.faults`), jobs' checkpoints, publications and events. None while a
        failed plan is retried in pieces.

        Raises:
            PlanMismatch, StepFailed: as `EngineCore.apply` (then `fail_plan`).
        """
        member = self._members[engine_id]
        step = member.core.apply(result)
        return None if step is None else self._after(member, step)

    def fail_plan(self, engine_id: str, plan: IterationPlan, message: str) -> list[str]:
        """A plan of the engine failed whole (`StepFailed`): its requests are aborted (their ids returned:
        the caller ends their streams), and its jobs' work fails with `message` (a driven run's call;
        any other job; `CoservedJob.fault`)."""
        member = self._members[engine_id]
        aborted = [p.key for p in plan_pieces(plan) if p.kind is PieceKind.REQUEST and self.abort(p.key)]
        for piece in plan_pieces(plan):
            job = member.jobs.get(piece.key) if piece.kind is PieceKind.JOB else None
            if job is not None:
                job.fault(message, own=False)
        return aborted

    def step(self, engine_id: str, executor: StepExecutor) -> Step:
        """Plan, execute on `executor` in this process, and apply (`EngineCore.step`)."""
        member = self._members[engine_id]
        self._steal_for(member)
        self.jobs.before_plan(member)
        return self._after(member, member.core.step(executor))

    def _steal_for(self, member: EngineMember) -> None:
        if len(self._members) < 2:
            return
        policy = member.policy
        steals = plan_steals(member, self._members.values(), self._vtc, policy.clock(),
                             policy.config.ttft_guard_s)
        for request, victim in steals:
            member.add(request)  # first: the tenant stays backlogged throughout (no second lift)
            victim.policy.withdraw(request.request_id)
            victim.forget(request)
            self._owner[request.request_id] = member.engine_id
            self.steals += 1

    def _after(self, member: EngineMember, step: Step) -> Step:
        member.sent(step.plan)
        for fault in step.result.faults:
            self.abort(fault.request_id)
        for request in member.after_step(step):
            self._owner.pop(request.request_id, None)
            self._pinned.discard(request.request_id)
        self.jobs.observe(member, step)
        return step
