"""Replay a trace against N real engines in this process, under one `EngineCluster`, on the wall clock.

Each engine is an `EngineActor` (the server's engine loop, as with `--local`): it builds its engine on a
thread of its own and steps it there, and between steps it calls `exchange(engine_id, result)` on a
`ClusterLink`, which applies the result and hands back that engine's next plan: the SchedulerActor's
contract, with the cluster's routing, late binding and job placement deciding. One lock serializes
the decisions (the scheduler is one thread's work, as on the actor's event loop); engine steps run
outside it, in parallel (on a CPU, give each engine one torch thread and one core).

Arrivals are submitted by the calling thread at their times; the fine-tuning jobs are placed at the
start. What is recorded is `cluster_run`'s: token times are when the scheduler applied the step, every
iteration carries its engine and the scheduler's thread CPU for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from coserve.bench.cluster_run import ClusterRecorder, ClusterRun, thread_seconds
from coserve.bench.replay import IDLE_SLEEP_S, PolicyFactory, RunLimits, should_stop
from coserve.bench.traces import RequestSpec
from coserve.cluster.engine_cluster import EngineCluster
from coserve.contract.engine import EngineFailure
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.inference.adapter_slots import AdapterSlots
from coserve.planner.latency_features import PlanFeatures
from coserve.planner.policy import CoServingPolicy
from coserve.tenancy.shared_vtc import SharedVtc


@dataclass(slots=True)
class _Handed:
    plan: IterationPlan
    start: float
    features: PlanFeatures


class ClusterLink:
    """The `SchedulerLink` of in-process engines driven by one cluster (module docstring).

    Args:
        recorder: the run's recorder (its cluster decides).
    """

    def __init__(self, recorder: ClusterRecorder) -> None:
        self._recorder = recorder
        self._cluster = recorder.cluster
        self._cond = threading.Condition()
        self._handed: dict[str, _Handed] = {}
        self._stopped = False
        self.error: str | None = None  # the first engine failure (a benchmark run does not expect any)

    def exchange(self, engine_id: str, result: IterationResult | EngineFailure | None) -> IterationPlan | None:
        with self._cond:
            cpu = thread_seconds()
            done = self._handed.pop(engine_id, None)
            step = None
            if done is not None and result is not None:
                if isinstance(result, EngineFailure):
                    self.error = self.error or f"{engine_id}: {result.message}"
                    self._stopped = True
                    self._cond.notify_all()
                    return None
                step = self._cluster.apply(engine_id, result)
            applied_at = self._recorder.now()  # its tokens' time
            while not self._stopped:
                plan = self._cluster.next_plan(engine_id)
                if step is not None and done is not None:
                    self._recorder.applied(engine_id, step, done.start, applied_at, done.features,
                                           thread_seconds() - cpu)
                    step = None
                if plan is not None:
                    self._handed[engine_id] = _Handed(plan, self._recorder.now(),
                                                      self._recorder.planned(engine_id, plan))
                    return plan
                # Nothing to run: wait for an arrival (or retry soon: work that cannot be placed yet).
                self._cond.wait(IDLE_SLEEP_S if self._cluster.has_work(engine_id) else 0.05)
                cpu = thread_seconds()
            return None

    def submit(self, spec: RequestSpec) -> None:
        with self._cond:
            self._recorder.submit(spec)
            self._cond.notify_all()

    def start_job(self, spec: FinetuneJobSpec) -> None:
        with self._cond:
            self._cluster.jobs.start(spec)
            self._cond.notify_all()

    def should_stop(self, limits: RunLimits, has_trace: bool, all_arrived: bool) -> bool:
        with self._cond:
            return self._stopped or should_stop(self._recorder.now(), limits, has_trace,
                                                self._recorder.unfinished, all_arrived)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


def replay_engines(engine_configs: Sequence[Any], make_policy: PolicyFactory, trace: Sequence[RequestSpec],
                   limits: RunLimits, *, jobs: Sequence[FinetuneJobSpec] = (), num_layers: int,
                   policy_name: str = "", rate: float = 0.0,
                   now: Callable[[], float] = time.monotonic) -> ClusterRun:
    """Build one engine per `EngineConfig` (each on its own thread), run the trace and the jobs through
    one cluster scheduler, and stop the engines (module docstring).

    Raises:
        RuntimeError: an engine step failed.
    """
    from coserve.actors.engine_actor import EngineActor

    actors = [EngineActor(config, engine_id=f"engine-{i}") for i, config in enumerate(engine_configs)]
    cluster = EngineCluster()
    t0 = now()
    for actor in actors:
        layout = actor.layout()

        def build(shared: SharedVtc, layout: Any = layout) -> CoServingPolicy:
            return make_policy(layout.num_kv_blocks, layout.block_size, AdapterSlots(layout.num_adapter_slots),
                               now, shared=shared)
        cluster.add_engine(actor.engine_id, build)
    recorder = ClusterRecorder(cluster, actors[0].layout().vocab_size, t0, now)
    link = ClusterLink(recorder)
    for spec in jobs:
        link.start_job(spec)
    for actor in actors:
        actor.start(link)
    pending = sorted(trace, key=lambda s: s.arrival_s)
    arrival = 0
    try:
        while not link.should_stop(limits, bool(pending), arrival == len(pending)):
            t = recorder.now()
            while arrival < len(pending) and pending[arrival].arrival_s <= t:
                link.submit(pending[arrival])
                arrival += 1
            wake = pending[arrival].arrival_s if arrival < len(pending) else t + 0.01
            time.sleep(max(0.0, min(wake - recorder.now(), 0.01)))
    finally:
        link.stop()
        for actor in actors:
            actor.join()
    if link.error is not None:
        raise RuntimeError(f"an engine step failed: {link.error}")
    return recorder.finish(pending, limits.window_s, num_layers, policy_name, rate)
