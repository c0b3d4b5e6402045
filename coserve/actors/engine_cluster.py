"""`ClusterEngines`: the SchedulerActor's N engines under one `ClusterScheduler` (`--engines N`).

Each engine has its own co-serving policy (KV blocks, adapter slots, latency model fitted on its own
iterations) and one plan in flight; all of them count with one set of virtual token counters, so a
tenant's fair share is of every engine together. A request is routed by load with affinity for the engine
that holds its adapter and its prompt's prefix; an idle engine takes waiting requests from a busy one
(late binding, inside `next_plan`); a job runs on the engine the cluster places it on, and its
checkpoints are published to every engine (the data dir is shared storage: one node, or a volume every
node mounts), so any engine serves the fine-tuned model at once. Losing an engine re-routes its requests
that have no token yet, strands the others (the actor ends their streams with an error) and moves its
jobs, each resuming from its last checkpoint on another engine; the engine registered again (Ray
restarted it) simply joins.
"""

from __future__ import annotations

from coserve.actors.engine_set import Budgets, EngineLoss, queue_state
from coserve.actors.job_runner import ClusterJobRunner, JobRunner
from coserve.actors.metrics import QueueState
from coserve.contract.engine import EngineFailure
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.cluster.cluster_scheduler import ClusterScheduler
from coserve.share.policy import CoServingPolicy
from coserve.cluster.engine_core import Step
from coserve.cluster.policy_factory import CoServingPolicyFactory, EngineLayout
from coserve.inference.request import Request, RequestStatus
from coserve.tenancy.shared_vtc import SharedVtc


class ClusterEngines:
    """Several engines, one scheduler's decisions (module docstring).

    Args:
        budgets: every engine policy's budgets.
        factory: builds each engine's co-serving policy with the cluster's shared counters.

    Raises:
        ValueError: `factory` cannot build policies over shared counters.
    """

    def __init__(self, budgets: Budgets, factory: CoServingPolicyFactory) -> None:
        if not isinstance(factory, CoServingPolicyFactory):
            raise ValueError("several engines need the co-serving policy (CoServingPolicyFactory): its "
                             "engines count with one set of virtual token counters")
        self._budgets, self._factory = budgets, factory
        self.cluster = ClusterScheduler(tenant_weights=factory.tenant_weights)
        self._jobs: ClusterJobRunner | None = None

    @property
    def ids(self) -> tuple[str, ...]:
        return self.cluster.engines

    @property
    def jobs(self) -> JobRunner | None:
        return self._jobs

    def add(self, engine_id: str, layout: EngineLayout) -> None:
        """Add an engine, new or restarted: held requests and waiting jobs are placed again."""
        config = self._budgets.config(layout)

        def build(shared: SharedVtc) -> CoServingPolicy:
            return self._factory(config, layout, shared=shared)

        member = self.cluster.add_engine(engine_id, build)
        if self._jobs is None and member.policy.jobs is not None:
            self._jobs = ClusterJobRunner(self.cluster.jobs)

    def lose(self, engine_id: str) -> EngineLoss:
        """The engine died: its plan in flight is gone (`ClusterScheduler.engine_lost`)."""
        failover = self.cluster.engine_lost(engine_id)
        for request in failover.stranded:  # produced tokens on the lost engine: cannot go on
            request.status = RequestStatus.FINISHED_ABORTED
        return EngineLoss(stranded=list(failover.stranded), rerouted=dict(failover.rerouted),
                          held=list(failover.waiting), jobs_lost=False)

    def submit(self, request: Request) -> str:
        return self.cluster.submit(request)

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        return self.cluster.abort(request_id, status)

    def has_work(self, engine_id: str) -> bool:
        return self.cluster.has_work(engine_id)

    def next_plan(self, engine_id: str) -> IterationPlan | None:
        return self.cluster.next_plan(engine_id)

    def in_flight(self, engine_id: str) -> IterationPlan | None:
        return self.cluster.in_flight(engine_id)

    def apply(self, engine_id: str, result: IterationResult | EngineFailure) -> Step:
        return self.cluster.apply(engine_id, result)

    def queue_states(self) -> dict[str, QueueState]:
        return {engine_id: queue_state(self.cluster.member(engine_id).policy) for engine_id in self.ids}
