"""Replay a trace against a policy and an executor, recording what every request and iteration did.

One driver (`drive`, iterations by `EngineCore.step`) serves both the real benchmark and the
simulator; they differ only in the clock and the executor (a `StepExecutor`):

* `replay` (this module): the wall clock and a real `TorchEngine` in this process. A request is added to the
  policy once its arrival time has passed; when the policy has nothing to run, the loop sleeps in
  short slices (at most `IDLE_SLEEP_S`) until the next arrival. Iteration times are what the machine
  took, scheduling included.
* `simulator.simulate`: a virtual clock and an executor that answers each plan as the engine would and
  advances the clock by the latency model's prediction.

What is recorded (`RunRecord`): for every request the arrival time and the time each of its output
tokens was sampled (the end of the iteration that sampled it); for every iteration its start and end,
the engine's own time, inference prefill/decode tokens, fine-tuning forward tokens and backward
token-layers, and the trained tokens of optimizer steps completed in it (`StepReport.num_tokens`:
fine-tuning progress counts completed optimizer steps only). Times are seconds from the run's start.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from coserve.bench.rollout_phases import RolloutPhases
from coserve.bench.traces import RequestSpec, prompt_token_ids
from coserve.cluster.engine_core import EngineCore
from coserve.contract.engine import StepExecutor
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.reinforcement import RolloutGrading
from coserve.contract.sampling import AdapterRef, EosIds, SamplingParams
from coserve.contract.training_plan import StepReport
from coserve.finetune.host import JobHost
from coserve.finetune.job import CoservedJob
from coserve.finetune.rollouts import RolloutDriver
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.request import Request
from coserve.planner.hold_kind import HoldKind
from coserve.planner.latency_features import PlanFeatures, plan_features
from coserve.planner.policy import CoServingPolicy
from coserve.tenancy.shared_vtc import SharedVtc

if TYPE_CHECKING:  # torch only where a real engine runs; the simulator imports this module too
    from coserve.torch_engine.engine import TorchEngine

IDLE_SLEEP_S = 0.002  # an idle loop checks for arrivals this often (short: TTFT is measured from it)


class Clock(Protocol):
    """Seconds on one scale: the policy's clock, request arrival times, iteration ends."""

    def now(self) -> float: ...

    def wait_until(self, t: float) -> None:
        """Let time pass to `t` (sleep, or jump a virtual clock)."""


class WallClock:
    """`time.monotonic`; waits sleep in slices of at most `IDLE_SLEEP_S`."""

    def now(self) -> float:
        return time.monotonic()

    def wait_until(self, t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(min(delay, IDLE_SLEEP_S))


@dataclass(slots=True)
class RequestRecord:
    """One request's life: arrival and the sampling time of each output token (run seconds)."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    tenant: str = "default"
    token_times: list[float] = field(default_factory=list)
    finished: bool = False

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        """Mean gap between consecutive output tokens; None with fewer than two tokens."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n >= 2 else None


@dataclass(slots=True)
class IterationRecord:
    """One executed iteration (run seconds; token counts of its plan)."""

    start_s: float
    end_s: float
    engine_s: float  # the executor's own measure (`IterationResult.timings.total_s`)
    features: PlanFeatures
    trained_tokens: int  # trained tokens of optimizer steps completed in this iteration
    engine_id: str = ""  # which engine ran it (several engines: `cluster_run`)
    decide_s: float = 0.0  # the scheduler's thread CPU to apply this result and plan the next (cluster runs)
    trained_sequences: int = 0  # trained sequences of those steps (a DPO pair is two)
    held: HoldKind | None = None  # why the plan gave a runnable job no work (None: it gave work, or none ran)

    @property
    def inference_tokens(self) -> int:
        return int(self.features.prefill_tokens + self.features.decode_tokens)

    def inside(self, window_s: float) -> float:
        """The fraction of this iteration inside [0, window_s]: 1 before its end, 0 after, a part across."""
        if self.start_s >= window_s:
            return 0.0
        if self.end_s <= window_s:
            return 1.0
        return (window_s - self.start_s) / (self.end_s - self.start_s)

    @property
    def has_work(self) -> bool:
        """Whether the plan computed anything (a plan of frees or job control alone does not)."""
        f = self.features
        return bool(f.num_sequences or f.ft_forward_tokens or f.ft_backward_token_layers)


def trained_work(steps: Sequence[StepReport]) -> tuple[int, int]:
    """The trained tokens and sequences of an iteration's completed optimizer steps."""
    return sum(s.num_tokens for s in steps), sum(s.num_sequences for s in steps)


@dataclass(slots=True)
class RunRecord:
    """Everything one run recorded; `window_s` is the arrival window throughputs are measured over."""

    policy: str
    rate: float
    window_s: float
    requests: list[RequestRecord]
    iterations: list[IterationRecord]
    num_layers: int
    ended_s: float = 0.0  # when the loop stopped (after the drain)
    rollout_phases: dict[str, Any] | None = None  # a reinforcement job's (`RolloutPhases.summary`)


@dataclass(frozen=True, slots=True)
class RunLimits:
    """When a run stops: all requests done after `window_s`, or `window_s + drain_s` at the latest.

    Requests still running then are judged on what they produced (see `metrics`); keep `drain_s` at
    least the TTFT SLO so a request without a first token at the stop has really missed it. Without a
    trace (fine-tuning only), the run lasts exactly `window_s`.
    """

    window_s: float
    drain_s: float = 5.0


class AdapterSlotTracker:
    """request id -> adapter slot of requests sent to the engine, for `plan_features` (the policy keeps
    its own map private)."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}

    def features(self, plan: IterationPlan) -> PlanFeatures:
        for request_id in plan.freed:
            self._slots.pop(request_id, None)
        for new in plan.new_sequences:
            self._slots[new.request_id] = new.adapter_slot
        return plan_features(plan, self._slots)


def make_request(spec: RequestSpec, vocab_size: int, t0: float) -> Request:
    """The policy's request for a trace entry: greedy, EOS ignored so it yields `output_len` tokens,
    through the trace's adapter if it names one (`adapter_ref`)."""
    return Request(spec.request_id, prompt_token_ids(spec, vocab_size),
                   SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True),
                   tenant=spec.tenant, arrival_time=t0 + spec.arrival_s,
                   adapter=None if spec.adapter is None else adapter_ref(spec.adapter))


def adapter_ref(name: str) -> AdapterRef:
    """The adapter a trace entry names: a stable 40-bit id from the name (below the training jobs' ids
    from 2**41), a path under /adapters (a simulated engine loads nothing)."""
    digest = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=5).digest(), "big")
    return AdapterRef(1 + digest % (2**40 - 1), name, f"/adapters/{name}")


class _Observed:
    """The lane's executor as the engine core sees it: notes each plan's features before the step
    and when the step ended (a token's time is the end of the engine's step, not of the update)."""

    def __init__(self, executor: StepExecutor, now: Callable[[], float]) -> None:
        self._executor, self._now = executor, now
        self._slots = AdapterSlotTracker()
        self.features = PlanFeatures()
        self.end = 0.0

    def step(self, plan: IterationPlan) -> IterationResult:
        self.features = self._slots.features(plan)
        result = self._executor.step(plan)
        self.end = self._now()
        return result


@dataclass(frozen=True, slots=True)
class RolloutSetup:
    """What a reinforcement job's rollout loop needs in a run: the ids sampling stops on, and its grader."""

    eos: EosIds
    grading: RolloutGrading


class EngineLane:
    """One engine's side of a run: its policy, executor and clock, and what it recorded.

    `drive` runs one lane to the end; the simulator's cluster mode interleaves several. A reinforcement
    job's rollout loop (`rollouts`) advances after every iteration, its phases recorded in `phases`.
    """

    def __init__(self, policy: CoServingPolicy, executor: StepExecutor, clock: Clock, *, vocab_size: int,
                 t0: float, on_iteration: Callable[[IterationRecord], None] | None = None) -> None:
        self.policy, self.executor, self.clock = policy, executor, clock
        self.vocab_size, self.t0 = vocab_size, t0
        self.records: dict[str, RequestRecord] = {}
        self.iterations: list[IterationRecord] = []
        self.unfinished = 0
        self.core = EngineCore(policy)
        self._observed = _Observed(executor, self.now)
        self._on_iteration = on_iteration
        self.rollouts: RolloutDriver | None = None
        self.phases = RolloutPhases()

    def start_rollouts(self, job: CoservedJob, setup: RolloutSetup) -> None:
        """Run the job's rollout loop beside it: its requests go to this lane's policy."""
        self.rollouts = RolloutDriver(job, setup.eos, setup.grading, self.policy.add_request, self.policy.abort,
                                      job.fail)

    def now(self) -> float:
        """Run seconds on this lane's clock."""
        return self.clock.now() - self.t0

    def add(self, spec: RequestSpec) -> None:
        """Hand an arrived request to the policy and start its record."""
        self.records[spec.request_id] = RequestRecord(spec.request_id, spec.arrival_s, spec.prompt_len,
                                                      spec.output_len, spec.tenant)
        self.unfinished += 1
        self.policy.add_request(make_request(spec, self.vocab_size, self.t0))

    def iterate(self) -> IterationRecord:
        """Plan, execute and apply one iteration; token times are the iteration's end."""
        start = self.now()
        step = self.core.step(self._observed)
        end = self._observed.end
        for request in step.advanced:
            record = self.records.get(request.request_id)
            if record is None:  # a rollout of the reinforcement job
                continue
            record.token_times.append(end)
            if request.is_finished:
                record.finished = True
                self.unfinished -= 1
        result = step.result
        tokens, sequences = trained_work(result.training.steps)
        if self.rollouts is not None:
            self.rollouts.advance(step)
            self.phases.observe(end, self.rollouts, len(result.training.steps))
        iteration = IterationRecord(start, end, result.timings.total_s, self._observed.features, tokens,
                                    trained_sequences=sequences, held=self.policy.floor.held_kind)
        self.iterations.append(iteration)
        if self._on_iteration is not None:
            self._on_iteration(iteration)
        return iteration


def drive(policy: CoServingPolicy, executor: StepExecutor, clock: Clock, trace: Sequence[RequestSpec],
          limits: RunLimits, *, vocab_size: int, num_layers: int, job: CoservedJob | None = None,
          policy_name: str = "", rate: float = 0.0,
          on_iteration: Callable[[IterationRecord], None] | None = None,
          rollouts: RolloutSetup | None = None) -> RunRecord:
    """Run the trace (and the job, if any) through `policy` and `executor` until `limits` say stop; a
    reinforcement job needs `rollouts`.

    The caller owns cleanup: `finish_run` hands the engine a plan that frees what is left.
    """
    pending = sorted(trace, key=lambda s: s.arrival_s)
    lane = EngineLane(policy, executor, clock, vocab_size=vocab_size, t0=clock.now(),
                      on_iteration=on_iteration)
    if job is not None:
        job_host(policy).add(job)
        if job.spec.rollouts is not None:
            if rollouts is None:
                raise ValueError(f"job {job.job_id} is a reinforcement job: its run needs a RolloutSetup")
            lane.start_rollouts(job, rollouts)
    next_arrival = 0
    while True:
        now = lane.now()
        while next_arrival < len(pending) and pending[next_arrival].arrival_s <= now:
            lane.add(pending[next_arrival])
            next_arrival += 1
        if should_stop(now, limits, bool(pending), lane.unfinished, next_arrival == len(pending)):
            break
        if lane.core.has_work():
            if not lane.iterate().has_work:
                # The policy has work it cannot place now (a job whose next piece does not fit the
                # budget, a request waiting for blocks): wait a slice instead of spinning on empty plans.
                clock.wait_until(clock.now() + IDLE_SLEEP_S)
            continue
        wake = pending[next_arrival].arrival_s if next_arrival < len(pending) else limits.window_s
        clock.wait_until(lane.t0 + min(wake, limits.window_s + limits.drain_s))
    if lane.rollouts is not None:
        lane.rollouts.stop()  # `finish_run` then cancels the job
    records = [lane.records.get(s.request_id) or RequestRecord(s.request_id, s.arrival_s, s.prompt_len,
                                                               s.output_len, s.tenant) for s in pending]
    return RunRecord(policy_name, rate, limits.window_s, records, lane.iterations, num_layers,
                     ended_s=lane.now(), rollout_phases=lane.phases.summary() if lane.rollouts else None)


def should_stop(now: float, limits: RunLimits, has_trace: bool, unfinished: int, all_arrived: bool) -> bool:
    """At the drain's end; without a trace at the window's end; else once every request arrived and
    finished after the window."""
    if now >= limits.window_s + limits.drain_s:
        return True
    if not has_trace:
        return now >= limits.window_s
    return now >= limits.window_s and all_arrived and unfinished == 0


def finish_run(policy: CoServingPolicy, executor: StepExecutor, request_ids: Sequence[str],
               job_id: str | None, max_plans: int = 4) -> None:
    """Abort unfinished requests and cancel the job, then run the plans that tell the engine to drop
    their state (frees and job stops), so the next run on the same engine starts clean."""
    for request_id in request_ids:
        policy.abort(request_id)  # False (a no-op) for finished ones
    if job_id is not None:
        job_host(policy).cancel(job_id)
    core = EngineCore(policy)
    for _ in range(max_plans):
        if not core.has_work():
            return
        core.step(executor)
    raise RuntimeError("the policy still has work after aborting every request and cancelling the job")


class PolicyFactory(Protocol):
    """(num_kv_blocks, block_size, adapters, clock) -> a policy planning for an engine of that shape,
    counting with a cluster's `shared` counters when given. The factory builds the KV block manager(s):
    a static split carves the cache into two ranges."""

    def __call__(self, num_blocks: int, block_size: int, adapters: AdapterSlots, clock: Callable[[], float],
                 *, shared: SharedVtc | None = None) -> CoServingPolicy: ...


def job_host(policy: CoServingPolicy) -> JobHost:
    """The policy's fine-tuning jobs (build a job on its `kv`: the policy's own, or its fine-tuning range).

    Raises:
        ValueError: the policy's share runs no jobs.
    """
    if policy.jobs is None:
        raise ValueError(f"a policy with the {policy.share.label} runs no fine-tuning job")
    return policy.jobs


def replay(engine: TorchEngine, make_policy: PolicyFactory, trace: Sequence[RequestSpec], limits: RunLimits,
           *, job_spec: FinetuneJobSpec | None = None, policy_name: str = "", rate: float = 0.0,
           clock: Clock | None = None, rollouts: RolloutSetup | None = None) -> RunRecord:
    """One benchmark run on a real engine, in this process, against the wall clock.

    A fresh policy, KV block managers and adapter slots per run (the engine's memory is reused: the
    previous run's `finish_run` dropped its sequences and job). The job, if any, starts with the run.
    """
    clock = clock or WallClock()
    layout = engine.layout
    adapters = AdapterSlots(layout.num_adapter_slots)
    policy = make_policy(layout.num_kv_blocks, layout.block_size, adapters, clock.now)
    job = CoservedJob(job_spec, job_host(policy).kv, adapters) if job_spec is not None else None
    try:
        return drive(policy, engine, clock, trace, limits, vocab_size=layout.vocab_size,
                     num_layers=engine.model_config.num_layers, job=job, policy_name=policy_name,
                     rate=rate, rollouts=rollouts)
    finally:
        finish_run(policy, engine, [s.request_id for s in trace], job_spec.job_id if job_spec else None)
