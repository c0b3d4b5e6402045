"""The co-serving benchmark's calibration run against a simulated GPU: the latency model coserve would fit.

`coserve bench co-serving` fits the policies' latency model in two passes on the engine under test
(`coserving_setup.calibrate`): a profiling sweep (`calibration.profile_engine`), then a few seconds of
coserve co-serving at the middle rate planned with the sweep's model, refitted on both; the safety margin
is the final fit's held-out bias (`LatencyFit.safety_margin`), coserve-strict's also covers the warm-up's
overrun. `calibrate_on_roofline` does the same against `SimulatedGpu`, an `Engine` whose iterations take
`roofline.RooflineModel`'s time on a virtual clock: the sweep is the benchmark's code with GPU sizes
(`GPU_SWEEP`: decode batches up to 128, prefill chunks of 2048 tokens, windows up to 1024 tokens beside 32
decodes, backward runs up to 8192 token-layers) and the warm-up is a simulated run.

The fitted model is linear (`LatencyModel`) and the roofline is not: it is right on average over the
iterations it was fitted on, wrong on either side of the ridge, and the policies refine their copies
online (RLS) with their overrun correction, as they would on a real GPU. The sweep, the margins and the
online refinement are all coserve's own; only the engine is simulated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from coserve.bench.calibration import MAX_MARGIN, LatencyFit, SweepSettings, fit_latency_model, profile_engine
from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits, RunRecord
from coserve.bench.roofline import RooflineModel
from coserve.bench.run_metrics import SLO
from coserve.bench.simulator import EngineShape, LatencyExecutor, VirtualClock, simulate
from coserve.bench.traces import LengthDistribution, make_trace, poisson_arrivals
from coserve.contract.engine import RuntimeLayout
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel, ModelFingerprint

GPU_SWEEP = SweepSettings(decode_batches=(1, 8, 32, 64, 128), prompt_lens=(256, 1024), decode_steps=6,
                          forward_windows=(32, 128, 512, 1024), backward_budgets=(1024, 4096, 8192),
                          mixed_decode_batch=32, max_batch_tokens=2048)
WARMUP_S = 6.0  # as the benchmark's second pass
REALIZED_TARGET = 0.9  # coserve-strict's margin aims co-served iterations here (as `coserving_setup`)


@dataclass(frozen=True, slots=True)
class SimulatedGpu:
    """An `Engine` for the calibration sweep: `layout`, and `step` answered by the roofline."""

    layout: RuntimeLayout
    executor: LatencyExecutor

    def step(self, plan: IterationPlan) -> IterationResult:
        return self.executor.step(plan)


def simulated_gpu(roofline: RooflineModel, shape: EngineShape, max_model_len: int) -> SimulatedGpu:
    layout = RuntimeLayout(num_kv_blocks=shape.num_kv_blocks, block_size=shape.block_size,
                           max_model_len=max_model_len, vocab_size=shape.vocab_size,
                           num_adapter_slots=shape.num_adapter_slots, max_lora_rank=16, dtype="bfloat16")
    return SimulatedGpu(layout, LatencyExecutor(roofline, VirtualClock()))


def co_served_overrun(run: RunRecord, model: LatencyModel) -> float:
    """Total time of the run's iterations holding decodes and fine-tuning over what `model` predicts for
    them (1.0 when there were none): the benchmark's warm-up overrun."""
    pairs = [(it.end_s - it.start_s, model.predict(it.features)) for it in run.iterations
             if it.features.decode_tokens and (it.features.ft_forward_tokens or it.features.ft_backward_token_layers)]
    predicted = sum(p for _, p in pairs)
    return sum(w for w, _ in pairs) / predicted if pairs and predicted > 0 else 1.0


def policy_setup(scheduler: SchedulerConfig, slo: SLO, fit: LatencyFit, stall_multiple: float,
                 strict_margin: float | None = None) -> PolicySetup:
    """The policies' setup from a fit: its margin, coserve's stall cap at `stall_multiple` TPOT SLOs."""
    return PolicySetup(scheduler=scheduler, slo=slo, latency=fit.model, safety_margin=fit.safety_margin,
                       max_stall_ms=stall_multiple * slo.tpot_s * 1000.0, strict_safety_margin=strict_margin)


def calibrate_on_roofline(roofline: RooflineModel, shape: EngineShape, scheduler: SchedulerConfig, slo: SLO,
                          job_spec: FinetuneJobSpec, warmup_rate: float, lengths: Sequence[LengthDistribution],
                          *, seed: int = 0, stall_multiple: float = 3.0, sweep: SweepSettings = GPU_SWEEP,
                          warmup_s: float = WARMUP_S) -> tuple[PolicySetup, LatencyFit, float]:
    """The benchmark's two-pass calibration (module docstring) on the simulated GPU; returns the setup,
    the final fit and the warm-up's overrun."""
    gpu = simulated_gpu(roofline, shape, scheduler.max_model_len)
    samples = profile_engine(gpu, dataclasses.replace(job_spec, job_id="calibration"), sweep)
    fingerprint = ModelFingerprint(roofline.model.name, f"{roofline.gpu.name} (roofline)", "bfloat16")
    first = fit_latency_model(samples, fingerprint)
    prompt, output = lengths
    trace = make_trace(poisson_arrivals(warmup_rate, warmup_s, seed + 7), seed + 7, lengths=(prompt, output),
                       prefix="w")
    warm = simulate(make_factory("coserve", policy_setup(scheduler, slo, first, stall_multiple)), trace,
                    RunLimits(warmup_s, 0.0), roofline, shape, job_spec=dataclasses.replace(job_spec, job_id="warmup"),
                    policy_name="coserve", rate=warmup_rate)
    samples += [(it.features, it.engine_s) for it in warm.iterations if it.engine_s > 0 and it.has_work]
    fit = fit_latency_model(samples, fingerprint)
    overrun = co_served_overrun(warm, fit.model)
    strict = max(fit.safety_margin, min(MAX_MARGIN, 1.0 - REALIZED_TARGET / overrun))
    return policy_setup(scheduler, slo, fit, stall_multiple, strict), fit, overrun
