"""`EngineSet`: the engines a SchedulerActor drives and the decisions over them, behind one surface.

* `SingleEngine` (`--engines 1`, `--local`): one engine's policy and its `EngineCore`. Losing the engine
  ends every live request (the actor fails their streams) and the jobs with it (the job manager is
  rebuilt when the engine is back and resumes them from their checkpoints, as after a restart).
* `ClusterEngines` (`engine_cluster.py`, `--engines N` > 1): a `ClusterScheduler` over N engines, each
  with its own policy and one plan in flight; losing one re-routes its requests that have no token yet,
  hands back the others (their streams end with an error) and moves its jobs to another engine, which
  resumes them from their last checkpoint.

The actor asks an `EngineSet` to route (`submit`), plan (`next_plan` per engine), take results (`apply`
per engine) and report queues (`queue_states`); it never touches a policy itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from coserve.actors.job_runner import HostJobs, JobRunner
from coserve.actors.metrics import QueueState
from coserve.contract.engine import EngineFailure
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.cluster.cluster_scheduler import NoEngine
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.cluster.engine_core import EngineCore, Step
from coserve.cluster.policy_factory import EngineLayout, InferencePolicy, PolicyFactory
from coserve.inference.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class Budgets:
    """The per-engine budgets every engine's policy plans with."""

    max_num_seqs: int
    max_batch_tokens: int
    enable_prefix_caching: bool = True

    def config(self, layout: EngineLayout) -> SchedulerConfig:
        """The policy's config over one engine's layout (an engine that keeps its own KV cache, vLLM,
        has its own prefix cache)."""
        return SchedulerConfig(max_model_len=layout.max_model_len, max_num_seqs=self.max_num_seqs,
                               max_batch_tokens=self.max_batch_tokens, block_size=layout.block_size,
                               enable_prefix_caching=self.enable_prefix_caching
                               and not layout.engine_owns_kv_cache)


@dataclass(slots=True)
class EngineLoss:
    """What losing an engine did to its work.

    Attributes:
        stranded: requests that cannot go on (their streams end with an error); None: every live
            request (one engine: nothing is left to serve them).
        rerouted: request id -> the engine it starts over on (no token of it was sent yet).
        held: re-routable requests waiting for an engine to join (none is left).
        jobs_lost: the in-memory jobs are gone with the engine (they resume from the store's
            checkpoints when it is back); False: they moved to other engines (the runner's notices).
    """

    stranded: list[Request] | None = None
    rerouted: dict[str, str] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    jobs_lost: bool = False


class EngineSet(Protocol):
    """What the SchedulerActor asks of its engines' decisions (module docstring)."""

    @property
    def ids(self) -> tuple[str, ...]:
        """The live engines."""

    @property
    def jobs(self) -> JobRunner | None:
        """Where co-served fine-tuning jobs run; None: the policies run none."""

    def add(self, engine_id: str, layout: EngineLayout) -> None: ...
    def lose(self, engine_id: str) -> EngineLoss: ...
    def submit(self, request: Request) -> str:
        """Queue a request on an engine; returns it. Raises NoEngine, or ValueError (nothing queued)."""

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool: ...
    def has_work(self, engine_id: str) -> bool: ...
    def next_plan(self, engine_id: str) -> IterationPlan | None: ...
    def in_flight(self, engine_id: str) -> IterationPlan | None: ...
    def apply(self, engine_id: str, result: IterationResult | EngineFailure) -> Step: ...
    def queue_states(self) -> dict[str, QueueState]: ...


def queue_state(policy: InferencePolicy) -> QueueState:
    kv = policy.kv
    return QueueState(waiting=policy.num_waiting, running=policy.num_running,
                      kv_blocks_used=kv.num_blocks - kv.num_free_blocks, kv_blocks_total=kv.num_blocks)


class SingleEngine:
    """One engine: its policy and iteration loop (module docstring).

    Args:
        budgets: the policy's budgets.
        factory: builds the policy over the engine's layout.
    """

    def __init__(self, budgets: Budgets, factory: PolicyFactory) -> None:
        self._budgets, self._factory = budgets, factory
        self._engine_id: str | None = None
        self._policy: InferencePolicy | None = None
        self._core: EngineCore | None = None
        self._jobs: HostJobs | None = None

    @property
    def ids(self) -> tuple[str, ...]:
        return () if self._engine_id is None else (self._engine_id,)

    @property
    def jobs(self) -> JobRunner | None:
        return self._jobs

    def add(self, engine_id: str, layout: EngineLayout) -> None:
        """Build the policy over the engine's layout (a fresh one for an engine back after `lose`).

        Raises:
            ValueError: an engine is already registered (one engine: `ClusterEngines` drives several).
        """
        if self._engine_id is not None:
            raise ValueError(f"engine {engine_id!r}: this scheduler drives one engine, {self._engine_id!r}")
        self._policy = self._factory(self._budgets.config(layout), layout)
        self._core = EngineCore(self._policy)
        self._jobs = None if self._policy.jobs is None else HostJobs(self._policy.jobs)
        self._engine_id = engine_id

    def lose(self, engine_id: str) -> EngineLoss:
        self._engine_id, self._policy, self._core, self._jobs = None, None, None, None
        return EngineLoss(stranded=None, jobs_lost=True)

    def submit(self, request: Request) -> str:
        if self._policy is None or self._engine_id is None:
            raise NoEngine("no engine is running")
        self._policy.add_request(request)
        return self._engine_id

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        return self._policy is not None and self._policy.abort(request_id, status)

    def has_work(self, engine_id: str) -> bool:
        return self._core.has_work()

    def next_plan(self, engine_id: str) -> IterationPlan | None:
        return self._core.next_plan()

    def in_flight(self, engine_id: str) -> IterationPlan | None:
        return self._core.in_flight

    def apply(self, engine_id: str, result: IterationResult | EngineFailure) -> Step:
        return self._core.apply(result)

    def queue_states(self) -> dict[str, QueueState]:
        if self._policy is None or self._engine_id is None:
            return {}
        return {self._engine_id: queue_state(self._policy)}
