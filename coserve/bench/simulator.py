"""The co-serving simulator: the same policy code, with a latency model instead of the engine.

`simulate` runs `replay.drive` (the benchmark's own loop) with a `VirtualClock` and a `LatencyExecutor`:
each plan is answered as the engine would answer it (a token for every sampled chunk, a `StepReport`
for every optimizer step, a `SavedAdapter` for every save) and the clock jumps by the latency model's
prediction for the plan's features (any `IterationCost`: a `LatencyModel`, or the GPU projection's
`roofline.RooflineModel`), plus a fixed per-iteration `overhead_s` (the scheduler's own time,
which a real replay pays on the wall clock but the engine's timer does not see). The policy refines its
own copy of the model from those times, as it would from measured ones.

`simulate_engines` runs N engines (one policy, KV cache and latency model each) under one
`EngineCluster`, with its routing, late binding and job placement, in `cluster_sim`'s event loop
(where the central scheduler's own time can be simulated too); `simulate_cluster` is its shorthand for
N engines of one model.

`gpu_latency_model` is a latency model for what-ifs at GPU scale (Llama-3.1-8B, bf16, one A100-80GB),
derived from published hardware figures rather than measured (see its docstring).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from coserve.bench.cluster_run import ClusterRun
from coserve.bench.cluster_sim import JobArrival, SchedulerCost, SimEngine, run_cluster
from coserve.bench.replay import AdapterSlotTracker, EngineLane, PolicyFactory, RunLimits, RunRecord, drive, job_host
from coserve.bench.traces import RequestSpec
from coserve.cluster.engine_cluster import EngineCluster
from coserve.cluster.routing import RoutingWeights
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.plan import IterationPlan, IterationResult, SampledToken, StepTimings
from coserve.contract.training_plan import SavedAdapter, StepReport, TrainingReport
from coserve.finetune.job import CoservedJob
from coserve.inference.adapter_slots import AdapterSlots
from coserve.planner.latency import LatencyModel, ModelFingerprint, PlanFeatures
from coserve.planner.policy import CoServingPolicy
from coserve.tenancy.shared_vtc import SharedVtc

SIMULATED_TOKEN = 17  # the token every simulated sample returns (requests ignore EOS)
# A run noisier than this (a machine under heavy contention) is not described by a latency model;
# the simulator caps the spread it imitates.
MAX_NOISE_SIGMA = 0.5


class IterationCost(Protocol):
    """What stands in for the engine's timing: an iteration's seconds from its features. A `LatencyModel`
    is one (the simulator's usual truth); `roofline.RooflineModel` is another (the GPU projection's)."""

    def predict(self, features: PlanFeatures) -> float: ...


class VirtualClock:
    """A clock that only moves when told: `advance` by an iteration, `wait_until` jumps."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def __call__(self) -> float:  # the policies take a zero-argument clock function
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def advance(self, seconds: float) -> None:
        self.t += seconds


class LatencyExecutor:
    """Answers plans like `Engine.step`, taking `model.predict(features) + overhead_s` virtual seconds.

    Args:
        model: the latency model standing in for the engine (not the policy's copy), or any other
            `IterationCost`.
        clock: advanced by each step.
        overhead_s: added to every iteration's duration but not to its reported engine time.
        noise_sigma: log-scale spread of a multiplicative, mean-preserving noise on each iteration's
            time (0: the model's prediction exactly); seeded by `seed`.
    """

    def __init__(self, model: IterationCost, clock: VirtualClock, overhead_s: float = 0.0,
                 noise_sigma: float = 0.0, seed: int = 0) -> None:
        self._model, self._clock, self._overhead_s = model, clock, overhead_s
        self._slots = AdapterSlotTracker()
        self._sigma = noise_sigma
        self._rng = random.Random(seed)

    def step(self, plan: IterationPlan) -> IterationResult:
        features = self._slots.features(plan)
        # A floor keeps time moving (and `observe` valid) if a plan of pure bookkeeping predicts 0.
        engine_s = max(self._model.predict(features), 1e-6)
        if self._sigma > 0:
            # Mean-preserving lognormal noise: a real engine's iterations scatter around the model
            # (its held-out MAPE), and the policy must plan through that error. Clamped to [1/3, 3]x:
            # a near-zero time would make the policy's relative-error RLS row explode.
            factor = math.exp(self._rng.gauss(-self._sigma ** 2 / 2, self._sigma))
            engine_s *= min(3.0, max(1.0 / 3.0, factor))
        self._clock.advance(engine_s + self._overhead_s)
        training = plan.training
        report = TrainingReport(
            steps=[StepReport(s.job_id, s.step, 1.0, 1.0, 0.0, s.num_sequences, s.num_tokens)
                   for s in training.optimizer_steps],
            saved=[SavedAdapter(s.job_id, s.path, s.step) for s in training.saves])
        return IterationResult(step_id=plan.step_id, num_tokens=plan.num_tokens,
                               sampled=[SampledToken(c.request_id, SIMULATED_TOKEN)
                                        for c in plan.chunks if c.sample],
                               timings=StepTimings(total_s=engine_s), training=report)


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What the policies need to know of a simulated engine (its `RuntimeLayout`, in short)."""

    num_kv_blocks: int
    block_size: int
    num_adapter_slots: int
    vocab_size: int
    num_layers: int


@dataclass(frozen=True, slots=True)
class SimSettings:
    """How simulated iterations deviate from the model: fixed overhead and noise (`LatencyExecutor`)."""

    overhead_s: float = 0.0
    noise_sigma: float = 0.0
    seed: int = 0


def _lane(make_policy: PolicyFactory, model: IterationCost, shape: EngineShape, sim: SimSettings,
          job_spec: FinetuneJobSpec | None, index: int = 0) -> tuple[EngineLane, CoservedJob | None]:
    clock = VirtualClock()
    adapters = AdapterSlots(shape.num_adapter_slots)
    policy = make_policy(shape.num_kv_blocks, shape.block_size, adapters, clock)
    executor = LatencyExecutor(model, clock, sim.overhead_s, sim.noise_sigma, sim.seed + index)
    job = CoservedJob(job_spec, job_host(policy).kv, adapters) if job_spec is not None else None
    return EngineLane(policy, executor, clock, vocab_size=shape.vocab_size, t0=0.0), job


def simulate(make_policy: PolicyFactory, trace: Sequence[RequestSpec], limits: RunLimits,
             model: IterationCost, shape: EngineShape, *, job_spec: FinetuneJobSpec | None = None,
             sim: SimSettings | None = None, policy_name: str = "", rate: float = 0.0) -> RunRecord:
    """One simulated run of one engine: `replay.replay`'s run with the latency model as the engine."""
    lane, job = _lane(make_policy, model, shape, sim or SimSettings(), job_spec)
    assert isinstance(lane.clock, VirtualClock)
    return drive(lane.policy, lane.executor, lane.clock, trace, limits, vocab_size=shape.vocab_size,
                 num_layers=shape.num_layers, job=job, policy_name=policy_name, rate=rate)


def simulate_engines(make_policy: PolicyFactory, trace: Sequence[RequestSpec], limits: RunLimits,
                     models: Sequence[IterationCost], shape: EngineShape, *, jobs: Sequence[JobArrival] = (),
                     sims: Sequence[SimSettings] = (), cost: SchedulerCost = SchedulerCost(),
                     routing: RoutingWeights = RoutingWeights(), policy_name: str = "",
                     rate: float = 0.0) -> ClusterRun:
    """One engine per model in `models` (engine i answered by `models[i]` with `sims[i]`, default no
    overhead or noise) under one `EngineCluster` (`cluster_sim.run_cluster`).

    Raises:
        ValueError: no model, or `sims` of another length.
    """
    if not models or (sims and len(sims) != len(models)):
        raise ValueError(f"need one latency model per engine (and one SimSettings each if any), got "
                         f"{len(models)} and {len(sims)}")
    cluster = EngineCluster(routing=routing)
    engines = []
    for i, model in enumerate(models):
        clock = VirtualClock()
        sim = sims[i] if sims else SimSettings()
        engine_id = f"engine-{i}"

        def build(shared: SharedVtc, clock: VirtualClock = clock) -> CoServingPolicy:
            return make_policy(shape.num_kv_blocks, shape.block_size, AdapterSlots(shape.num_adapter_slots),
                               clock, shared=shared)
        cluster.add_engine(engine_id, build)
        executor = LatencyExecutor(model, clock, sim.overhead_s, sim.noise_sigma, sim.seed + i)
        engines.append(SimEngine(engine_id, executor, clock))
    return run_cluster(cluster, engines, trace, limits, vocab_size=shape.vocab_size, num_layers=shape.num_layers,
                       jobs=jobs, cost=cost, policy_name=policy_name, rate=rate)


def simulate_cluster(make_policy: PolicyFactory, trace: Sequence[RequestSpec], limits: RunLimits,
                     model: IterationCost, shape: EngineShape, num_engines: int, *,
                     job_specs: Sequence[FinetuneJobSpec] = (), sim: SimSettings | None = None,
                     policy_name: str = "", rate: float = 0.0) -> RunRecord:
    """N simulated engines of one latency model under one `EngineCluster` (`simulate_engines`); the
    jobs of `job_specs` are submitted at the start and placed by the scheduler.

    The record merges every engine's requests and iterations (iteration times are per engine;
    throughputs add up over the shared window).
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    base = sim or SimSettings()
    return simulate_engines(make_policy, trace, limits, [model] * num_engines, shape,
                            jobs=[JobArrival(0.0, spec) for spec in job_specs], sims=[base] * num_engines,
                            policy_name=policy_name, rate=rate).run


def truth_model_from_run(run: RunRecord, fingerprint: ModelFingerprint) -> tuple[LatencyModel, float]:
    """The simulator's stand-in for the engine of a measured run, and the spread of its error.

    `LatencyModel.fit` minimises *relative* error (what the planner needs), which sits below the mean
    when a few iterations run long (a busy machine): its total over a run falls short of the measured
    total. The simulator needs the total right, so the fitted coefficients are scaled by
    ``sum(measured) / sum(predicted)``. The returned sigma is the standard deviation of
    ``log(measured / predicted)`` after scaling (at most `MAX_NOISE_SIGMA`), for
    `SimSettings.noise_sigma`.
    """
    samples = [(it.features, it.engine_s) for it in run.iterations if it.engine_s > 0 and it.has_work]
    model = LatencyModel(fingerprint)
    model.fit(samples)
    predicted = [model.predict(f) for f, _ in samples]
    scale = sum(s for _, s in samples) / max(sum(predicted), 1e-12)
    scaled = LatencyModel(fingerprint, {k: v * scale for k, v in model.coefficients.items()})
    logs = [math.log(s / max(p * scale, 1e-12)) for (_, s), p in zip(samples, predicted)]
    mean = sum(logs) / len(logs)
    sigma = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    return scaled, min(sigma, MAX_NOISE_SIGMA)


def measured_overhead_s(run: RunRecord, idle_gap_s: float = 0.05) -> float:
    """Mean time between consecutive iteration starts beyond the engine's own time: the scheduler and
    loop cost a replay pays on the wall clock. Gaps longer than `idle_gap_s` (idle waits) are left out."""
    its = run.iterations
    gaps = [b.start_s - a.start_s - a.engine_s for a, b in zip(its, its[1:])
            if b.start_s - a.end_s < idle_gap_s]
    return max(0.0, sum(gaps) / len(gaps)) if gaps else 0.0


def gpu_latency_model() -> LatencyModel:
    """An iteration latency model for Llama-3.1-8B in bf16 on one A100-80GB, from published figures.

    Sources and arithmetic (not a measurement; use it for what-ifs, not for claims about a GPU):

    * constant 4 ms: per-iteration launch and scheduling overhead of an eager engine (vLLM's own
      profiles of small-batch decode show a few ms outside the matmuls).
    * decode token 3e-5 s and prefill token 6e-5 s: 2 x 8e9 FLOPs per token at ~50% of the A100's 312
      TFLOPS bf16 peak (NVIDIA A100 datasheet) is ~1e-4 s per prefill token; decode rows ride along
      the weight reads, which cost 16 GB / 2.0 TB/s = 8 ms per iteration and sit in the constant
      plus the per-sequence term below.
    * decode_context 6.5e-8 s per key: K/V of one token are 32 layers x 8 KV heads x 128 x 2 x 2 bytes
      = 131 KB, read at 2.0 TB/s.
    * ft_forward_tokens 1e-4 s (a prefill token plus keeping the layer inputs) and
      ft_backward_token_layers 6.4e-6 s (backward ~2x forward, over 32 layers).
    * num_sequences 2.5e-4 s: per-sequence metadata and sampling.
    With these, one decode iteration of 8 requests at a 1k context takes ~7 ms of work above the
    constant, so FlexLLM's 50 ms TPOT SLO for this model leaves room for fine-tuning, as in its
    Figure 10.
    """
    coefficients = {"constant": 4e-3, "decode_tokens": 3e-5, "prefill_tokens": 6e-5,
                    "decode_context": 6.5e-8, "ft_forward_tokens": 1e-4,
                    "ft_backward_token_layers": 6.4e-6, "num_sequences": 2.5e-4,
                    "distinct_adapters": 2e-4}
    return LatencyModel(ModelFingerprint("llama-3.1-8b", "a100-80gb (published figures)", "bfloat16"),
                        coefficients)
