"""The simulator against a measured run: the same trace and policy on a model of the run's engine.

Each measured coserve run is replayed in the simulator with a latency model fitted on that run's own
iterations (`simulator.truth_model_from_run`), its measured loop overhead and its noise, once per noise
seed. A metric's simulated value is the mean over the seeds and its error is relative to the measured
value; the seeds' range is reported with it. The range matters for TTFT under fine-tuning bursts: an
arrival's TTFT depends on whether a burst is in flight when it comes (a matter of a few ms of phase), so
with ~20-60 requests per run its p50 and mean move between equally likely timings by more than the model
is off, in the simulator and in the measured run alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits, RunRecord
from coserve.bench.run_metrics import relative_error, summarize
from coserve.bench.simulator import EngineShape, SimSettings, measured_overhead_s, simulate, truth_model_from_run
from coserve.bench.traces import RequestSpec
from coserve.contract.job_spec import FinetuneJobSpec

SIM_CHECK_KEYS = ("inference_tokens_per_s", "finetune_tokens_per_s", "finetune_steady_tokens_per_s",
                  "tpot_mean_ms", "ttft_p50_ms", "ttft_mean_ms")
SIM_SEEDS = 3  # noise seeds per check: each simulation of a 16-40 s run takes ~1-3 s here


def simulator_check(record: RunRecord, setup: PolicySetup, trace: list[RequestSpec], limits: RunLimits,
                    job_spec: FinetuneJobSpec, shape: EngineShape, seeds: int = SIM_SEEDS) -> dict[str, Any]:
    """Replay `record`'s run in the simulator once per noise seed; per metric: measured, simulated (the
    seeds' mean), its relative error, and the seeds' [min, max]."""
    model, sigma = truth_model_from_run(record, setup.latency.fingerprint)
    overhead = measured_overhead_s(record)
    simulated: list[dict[str, Any]] = []
    for seed in range(seeds):
        sim = simulate(make_factory(record.policy, setup), trace, limits, model, shape,
                       job_spec=dataclasses.replace(job_spec, job_id=f"sim-{seed}"),
                       policy_name=record.policy, rate=record.rate,
                       sim=SimSettings(overhead_s=overhead, noise_sigma=sigma, seed=seed))
        simulated.append(summarize(sim, setup.slo).to_dict())
    measured: dict[str, Any] = summarize(record, setup.slo).to_dict()
    return {"policy": record.policy, "rate": record.rate, "noise_sigma": sigma, "seeds": seeds,
            **{key: _compare(measured[key], [s[key] for s in simulated]) for key in SIM_CHECK_KEYS}}


def _compare(measured: float | None, simulated: list[float | None]) -> dict[str, Any]:
    values = [v for v in simulated if v is not None]
    mean = sum(values) / len(values) if values else None
    return {"measured": measured, "simulated": mean,
            "error": _finite(relative_error(mean, measured)),
            "simulated_range": [min(values), max(values)] if values else None}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no inf
