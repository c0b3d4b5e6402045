"""N simulated engines behind one central scheduler: the `EngineCluster`'s own code (routing, late
binding, job placement, publication) decides, executors answer plans (the latency model, `simulator`),
and the scheduler's own time is part of the simulation.

`run_cluster` is a discrete-event loop over three kinds of events, in time order:

* an arrival: the scheduler routes the request (`EngineCluster.submit`);
* a job arrival: the scheduler places the job (`ClusterJobs.start`);
* an engine's step ends: the scheduler applies its result and hands it its next plan, one exchange as
  the SchedulerActor's `exchange` does (`apply`, then `next_plan`). The engine then executes the plan
  (the executor says how long it takes) and its next exchange is due when that time has passed.

The scheduler is one server: it handles one event at a time, in the order they happen, and each costs
it `SchedulerCost`: the thread CPU the real decision code just took in this process (`measured`), plus
a fixed cost per plan handed out (transport: a Ray round trip) and per sampled token (the actor's
output processing: detokenizing, streams). An event that happens while it is busy waits; so an engine
whose step ended waits for its next plan, and the time engines spend waiting for their plans (queueing
and the scheduler's work on them) is the measure of the scheduler becoming the bottleneck
(`ClusterRun.engine_wait_s`). With no cost (the default), decisions
take no simulated time, as in the single-engine simulator.

A token's time is the end of the exchange that applied its step. An engine with nothing to plan waits
for the next arrival or job (or, with work it cannot place yet, retries after `IDLE_SLEEP_S`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from coserve.bench.cluster_run import ClusterRecorder, ClusterRun, thread_seconds
from coserve.bench.replay import IDLE_SLEEP_S, Clock, RunLimits, should_stop
from coserve.bench.traces import RequestSpec
from coserve.cluster.engine_cluster import EngineCluster
from coserve.contract.engine import StepExecutor
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.planner.latency_features import PlanFeatures

_WAKE, _DONE = 0, 1


@dataclass(frozen=True, slots=True)
class SchedulerCost:
    """What the central scheduler's work costs in simulated time (module docstring).

    Attributes:
        measured: charge each decision the thread CPU it took here (routing, apply + plan).
        per_exchange_s: added per plan handed to an engine (e.g. a Ray actor round trip).
        per_token_s: added per sampled token (the SchedulerActor's detokenizing and streaming).
    """

    measured: bool = False
    per_exchange_s: float = 0.0
    per_token_s: float = 0.0


@dataclass(frozen=True, slots=True)
class JobArrival:
    """A fine-tuning job submitted `at_s` seconds into the run."""

    at_s: float
    spec: FinetuneJobSpec


@dataclass(slots=True)
class SimEngine:
    """One simulated engine: the executor answering its plans and the clock its policy reads (the
    executor advances it by each step's duration)."""

    engine_id: str
    executor: StepExecutor
    clock: Clock


@dataclass(slots=True)
class _InFlight:
    plan: IterationPlan
    result: IterationResult
    start: float
    features: PlanFeatures


class _Loop:
    """The event loop's state (module docstring)."""

    def __init__(self, cluster: EngineCluster, engines: Sequence[SimEngine], cost: SchedulerCost,
                 recorder: ClusterRecorder) -> None:
        self.cluster, self.cost, self.recorder = cluster, cost, recorder
        self.engines = {e.engine_id: e for e in engines}
        self.now = 0.0
        self.free_at = 0.0  # when the scheduler is next free
        self.busy_s = self.wait_s = 0.0
        self.events: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.idle: set[str] = set()
        self.in_flight: dict[str, _InFlight] = {}
        for engine_id in self.engines:
            self.push(0.0, _WAKE, engine_id)

    def push(self, t: float, kind: int, engine_id: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, engine_id))

    def next_event_s(self) -> float:
        return self.events[0][0] if self.events else math.inf

    def _serve(self, t: float, cpu_s: float, extra_s: float = 0.0) -> float:
        """The scheduler handles an event of time `t` that took `cpu_s` of its CPU; returns when done."""
        start = max(t, self.free_at)
        busy = (cpu_s if self.cost.measured else 0.0) + extra_s
        self.free_at = start + busy
        self.busy_s += busy
        return self.free_at

    def arrive(self, t: float, spec: RequestSpec) -> None:
        self.now = t
        self.recorder.submit(spec)
        self._serve(t, self.recorder.route_s[-1])
        self._wake_idle()

    def job(self, t: float, spec: FinetuneJobSpec) -> None:
        self.now = t
        cpu = thread_seconds()
        self.cluster.jobs.start(spec)
        self._serve(t, thread_seconds() - cpu)
        self._wake_idle()

    def _wake_idle(self) -> None:
        for engine_id in sorted(self.idle):
            self.push(self.free_at, _WAKE, engine_id)
        self.idle.clear()

    def exchange(self) -> None:
        """The earliest engine event: apply its result (if its step ended) and hand it its next plan."""
        t, _, kind, engine_id = heapq.heappop(self.events)
        self.now = t
        engine = self.engines[engine_id]
        start = max(t, self.free_at)
        engine.clock.wait_until(start)  # its policy plans at the time the scheduler gets to it
        cpu = thread_seconds()
        step, done = None, self.in_flight.pop(engine_id, None) if kind == _DONE else None
        if done is not None:
            step = self.cluster.apply(engine_id, done.result)
        plan = self.cluster.next_plan(engine_id)
        cpu = thread_seconds() - cpu
        tokens = len(done.result.sampled) if done is not None else 0
        extra = self.cost.per_token_s * tokens + (self.cost.per_exchange_s if plan is not None else 0.0)
        end = self._serve(t, cpu, extra)
        self.wait_s += end - t  # the engine idles until its plan: queueing and the scheduler's work
        if done is not None and step is not None:
            self.recorder.applied(engine_id, step, done.start, end, done.features, cpu)
        if plan is not None:
            features = self.recorder.planned(engine_id, plan)
            engine.clock.wait_until(end)
            result = engine.executor.step(plan)
            self.in_flight[engine_id] = _InFlight(plan, result, end, features)
            self.push(engine.clock.now(), _DONE, engine_id)
        elif self.cluster.has_work(engine_id):  # work it cannot place now: retry, never spin
            self.push(end + IDLE_SLEEP_S, _WAKE, engine_id)
        else:
            self.idle.add(engine_id)


def run_cluster(cluster: EngineCluster, engines: Sequence[SimEngine], trace: Sequence[RequestSpec],
                limits: RunLimits, *, vocab_size: int, num_layers: int, jobs: Sequence[JobArrival] = (),
                cost: SchedulerCost = SchedulerCost(), policy_name: str = "", rate: float = 0.0) -> ClusterRun:
    """Run the trace and the jobs through `cluster`, whose engines are `engines` (added already, with
    clocks starting at 0), until `limits` say stop (module docstring)."""
    pending = sorted(trace, key=lambda s: s.arrival_s)
    job_queue = sorted(jobs, key=lambda j: j.at_s)
    loop_ref: list[_Loop] = []
    recorder = ClusterRecorder(cluster, vocab_size, 0.0, lambda: loop_ref[0].now if loop_ref else 0.0)
    loop = _Loop(cluster, engines, cost, recorder)
    loop_ref.append(loop)
    arrival = job_index = 0
    while True:
        next_arrival = pending[arrival].arrival_s if arrival < len(pending) else math.inf
        next_job = job_queue[job_index].at_s if job_index < len(job_queue) else math.inf
        t = min(next_arrival, next_job, loop.next_event_s())
        if t == math.inf or should_stop(t, limits, bool(pending), recorder.unfinished, arrival == len(pending)):
            loop.now = min(t, limits.window_s + limits.drain_s)
            break
        if next_job == t:
            loop.job(t, job_queue[job_index].spec)
            job_index += 1
        elif next_arrival == t:
            loop.arrive(t, pending[arrival])
            arrival += 1
        else:
            loop.exchange()
    return recorder.finish(pending, limits.window_s, num_layers, policy_name, rate,
                           scheduler_busy_s=loop.busy_s, engine_wait_s=loop.wait_s)
