"""What a run of several engines under one `EngineCluster` records, for the real driver
(`cluster_replay`) and the simulator (`cluster_sim`) alike.

The records are `replay`'s: one `RequestRecord` per trace entry (arrival, the time of each output
token) and one `IterationRecord` per executed iteration, tagged with its engine and with the
scheduler's own thread CPU for it (`decide_s`: applying its result and planning the next, including the
late binding before the plan). A token's time is when the scheduler applied the step that sampled it:
what a client could see first, queueing at the scheduler included. Each arrival's routing is timed too
(`ClusterRun.route_s`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from coserve.bench.replay import (
    AdapterSlotTracker,
    IterationRecord,
    RequestRecord,
    RunRecord,
    make_request,
    trained_work,
)
from coserve.bench.traces import RequestSpec
from coserve.cluster.engine_cluster import EngineCluster
from coserve.cluster.engine_core import Step
from coserve.contract.plan import IterationPlan
from coserve.planner.latency_features import PlanFeatures


@dataclass(slots=True)
class ClusterRun:
    """A run's records over all engines, and what the central scheduler spent."""

    run: RunRecord  # requests of the whole trace; iterations of every engine, by start time
    engines: tuple[str, ...]
    route_s: list[float] = field(default_factory=list)  # thread CPU of routing each arrival
    steals: int = 0  # requests an engine took over before admission (`work_stealing`)
    scheduler_busy_s: float = 0.0  # simulated runs: time the central scheduler was busy (its cost model)
    engine_wait_s: float = 0.0  # simulated runs: time engines waited for their next plans

    def engine_iterations(self, engine_id: str) -> list[IterationRecord]:
        return [it for it in self.run.iterations if it.engine_id == engine_id]

    def decide_s(self) -> list[float]:
        """The scheduler's thread CPU per executed iteration."""
        return [it.decide_s for it in self.run.iterations]


def thread_seconds() -> float:
    """This thread's CPU time: what the scheduler's work costs, unlike the wall clock, which also counts
    the time other processes of a shared machine took."""
    return time.thread_time()


class ClusterRecorder:
    """Requests routed through `cluster` and the iterations of its engines, as they happen.

    Args:
        cluster: the scheduler (the caller serializes calls, as the cluster requires).
        vocab_size: for the trace's prompts.
        t0: the clock's value at the run's start (run seconds are measured from it).
        now: the clock.
    """

    def __init__(self, cluster: EngineCluster, vocab_size: int, t0: float, now: Callable[[], float]) -> None:
        self.cluster, self.vocab_size, self.t0, self._now = cluster, vocab_size, t0, now
        self.records: dict[str, RequestRecord] = {}
        self.iterations: list[IterationRecord] = []
        self.unfinished = 0
        self.route_s: list[float] = []
        self._trackers: dict[str, AdapterSlotTracker] = {}

    def now(self) -> float:
        """Run seconds."""
        return self._now() - self.t0

    def submit(self, spec: RequestSpec) -> str:
        """Start the request's record and route it; returns its engine."""
        self.records[spec.request_id] = RequestRecord(spec.request_id, spec.arrival_s, spec.prompt_len,
                                                      spec.output_len, spec.tenant)
        self.unfinished += 1
        request = make_request(spec, self.vocab_size, self.t0)
        t = thread_seconds()
        engine = self.cluster.submit(request)
        self.route_s.append(thread_seconds() - t)
        return engine

    def planned(self, engine_id: str, plan: IterationPlan) -> PlanFeatures:
        """The plan's features (every plan of an engine passes here, in order: it tracks adapter slots)."""
        tracker = self._trackers.setdefault(engine_id, AdapterSlotTracker())
        return tracker.features(plan)

    def applied(self, engine_id: str, step: Step, start: float, end: float, features: PlanFeatures,
                decide_s: float) -> IterationRecord:
        """Record an applied step that ran from `start` to `end` (run seconds; `end` is also its tokens'
        time)."""
        for request in step.advanced:
            record = self.records.get(request.request_id)
            if record is None:
                continue
            record.token_times.append(end)
            if request.is_finished:
                record.finished = True
                self.unfinished -= 1
        tokens, sequences = trained_work(step.result.training.steps)
        iteration = IterationRecord(start, end, step.result.timings.total_s, features, tokens, engine_id,
                                    decide_s, sequences)
        self.iterations.append(iteration)
        return iteration

    def finish(self, trace: Sequence[RequestSpec], window_s: float, num_layers: int, policy: str,
               rate: float, **stats: float) -> ClusterRun:
        """The run's records (a trace entry never submitted gets an empty record)."""
        records = [self.records.get(s.request_id) or RequestRecord(s.request_id, s.arrival_s, s.prompt_len,
                                                                    s.output_len, s.tenant) for s in trace]
        iterations = sorted(self.iterations, key=lambda it: it.start_s)
        run = RunRecord(policy, rate, window_s, records, iterations, num_layers, ended_s=self.now())
        return ClusterRun(run, self.cluster.engines, self.route_s, self.cluster.steals, **stats)

