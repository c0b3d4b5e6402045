"""`coserve bench cluster project`: N engines x 1000 tenants in the cluster simulator, and where the
central scheduler becomes the bottleneck.

    coserve bench cluster project --from VALIDATION.json --json OUT [--engines 1,2,4,8,16] [--plots DIR]
    coserve bench cluster project --engine-model a100 --json OUT [--engines 1,4,16,32,64]

Engines (each a `LatencyExecutor` under one `EngineCluster`, `simulator.simulate_engines`):

* ``measured`` (with ``--from``): the latency model fitted on the measured 1-engine run of a
  `cluster validate` result (its loop overhead and noise too), planned with that run's policy settings
  and SLOs, on the co-serving benchmark's lengths (ShareGPT / 4): N engines like this machine's;
* ``a100``: Llama-3.1-8B on one A100 (`simulator.gpu_latency_model`, from published figures, not
  measured), FlexLLM's SLOs (TPOT 50 ms, TTFT 5 s), full ShareGPT lengths, 64 running requests.

Workload (`tenant_traces`): 1000 tenants with Zipf(1.1) sizes, diurnal and bursty arrivals at
`rate_per_engine x N` requests/s, 20% of the tenants on an adapter of their own, 70% of requests
starting with their tenant's system prompt; one fine-tuning job per engine on average (3 small : 1
large), submitted over the first half of the window and placed by the cluster.

The central scheduler's time (`cluster_sim.SchedulerCost`), two ways per point:

* ``decisions``: the thread CPU the cluster's decision code (routing, late binding, apply and plan of
  every engine) took in this process, charged as simulated time;
* ``actor``: that plus `ACTOR_TOKEN_S` per sampled token for the SchedulerActor's output processing
  (detokenizing, stream batches, metrics), derived from the serving-path measurement in
  benchmarks/RESULTS.md ("Serving path (issue 5)": 1.82 ms outside the step per iteration of 16
  streams in `--local` mode, of which ~0.2 ms planning: ~0.1 ms per token).

Reported per point: SLO attainment (all, the 10 largest tenants, the rest), throughputs, TTFT and TPOT
percentiles, the scheduler's CPU per iteration (p50, p99), its utilization (busy time over the run)
and the share of engine time spent waiting for it: the scheduler is the bottleneck where utilization
nears 1 and engines start to wait.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coserve.bench.cluster_run import ClusterRun
from coserve.bench.cluster_sim import JobArrival, SchedulerCost
from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits
from coserve.bench.run_metrics import SLO, slo_attainment, summarize
from coserve.bench.simulator import EngineShape, SimSettings, gpu_latency_model, simulate_engines
from coserve.bench.tenant_traces import TenantMix, diurnal_arrivals, job_mix, tenant_names, tenant_trace
from coserve.bench.traces import LengthDistribution, sharegpt_lengths
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel, ModelFingerprint

ACTOR_TOKEN_S = 1e-4  # the SchedulerActor's output processing per sampled token (module docstring)
COSTS = {"decisions": SchedulerCost(measured=True),
         "actor": SchedulerCost(measured=True, per_token_s=ACTOR_TOKEN_S)}


@dataclass(frozen=True, slots=True)
class EngineKind:
    """What every simulated engine of a projection is."""

    name: str
    setup: PolicySetup
    model: LatencyModel  # the engine's truth (the executor)
    sim: SimSettings
    shape: EngineShape
    lengths: tuple[LengthDistribution, LengthDistribution]
    mix: TenantMix


def a100_engine() -> EngineKind:
    """Llama-3.1-8B on an A100, from published figures (module docstring)."""
    from coserve.bench.whatif import SHAPE, SLO_8B

    setup = PolicySetup(scheduler=SchedulerConfig(max_model_len=8192, max_num_seqs=64, max_batch_tokens=2048,
                                                  block_size=16), slo=SLO_8B, latency=gpu_latency_model())
    lengths = sharegpt_lengths(scale=1.0, prompt_range=(4, 2048), output_range=(2, 1024))
    return EngineKind("a100", setup, gpu_latency_model(), SimSettings(), SHAPE, lengths, TenantMix())


def measured_engine(validation: dict[str, Any]) -> EngineKind:
    """This machine's engine as measured by `cluster validate` (its 1-engine run at the highest rate)."""
    setup_raw = validation["setup"]
    fingerprint = ModelFingerprint(**setup_raw["fingerprint"])
    policy_model = LatencyModel(fingerprint, validation["policy_latency_model"]["coefficients"])
    setup = PolicySetup(scheduler=SchedulerConfig(**setup_raw["scheduler"]), slo=SLO(**setup_raw["slo"]),
                        latency=policy_model, safety_margin=setup_raw["safety_margin"],
                        max_stall_ms=setup_raw["max_stall_ms"])
    single = max((r for r in validation["runs"] if r["engines"] == 1), key=lambda r: r["rate_per_engine"])
    truth = LatencyModel(fingerprint, single["engine_models"][0])
    sim = SimSettings(**single["engine_sims"][0])
    return EngineKind("measured", setup, truth, sim, EngineShape(**validation["shape"]), sharegpt_lengths(),
                      TenantMix(prefix_len=16))


def project_point(kind: EngineKind, engines: int, rate_per_engine: float, window_s: float, cost_name: str,
                  seed: int, num_tenants: int = 1000) -> dict[str, Any]:
    """One simulated run of `engines` engines of `kind`; its metrics row (module docstring)."""
    mix = TenantMix(num_tenants=num_tenants, zipf_s=kind.mix.zipf_s, adapter_fraction=kind.mix.adapter_fraction,
                    prefix_len=kind.mix.prefix_len, prefix_prob=kind.mix.prefix_prob)
    rate = rate_per_engine * engines
    trace = tenant_trace(diurnal_arrivals(rate, window_s, seed, period_s=window_s), seed, mix, kind.lengths)
    jobs: list[JobArrival] = job_mix(engines, window_s, seed, num_layers=kind.shape.num_layers,
                                     vocab_size=kind.shape.vocab_size, mix=mix)
    limits = RunLimits(window_s, drain_s=kind.setup.slo.ttft_s)
    t0 = time.monotonic()
    result = simulate_engines(make_factory("coserve", kind.setup), trace, limits, [kind.model] * engines,
                              kind.shape, jobs=jobs, sims=[kind.sim] * engines, cost=COSTS[cost_name],
                              policy_name="coserve", rate=rate)
    return {"engines": engines, "rate": rate, "cost": cost_name, "wall_s": time.monotonic() - t0,
            **summarize(result.run, kind.setup.slo).to_dict(),
            **_by_tenant_class(result, kind.setup.slo, tenant_names(mix)[:10]),
            **scheduler_stats(result), "jobs": len(jobs)}


def _by_tenant_class(result: ClusterRun, slo: SLO, top: list[str]) -> dict[str, Any]:
    run, top_set = result.run, set(top)
    big = [r for r in run.requests if r.tenant in top_set]
    rest = [r for r in run.requests if r.tenant not in top_set]
    return {"slo_attainment_top10_tenants": slo_attainment(_with(run, big), slo),
            "slo_attainment_other_tenants": slo_attainment(_with(run, rest), slo)}


def _with(run: Any, requests: list[Any]) -> Any:
    return type(run)(run.policy, run.rate, run.window_s, requests, [], run.num_layers)


def scheduler_stats(result: ClusterRun) -> dict[str, Any]:
    """The central scheduler's CPU per iteration, its utilization and the engines' wait for it."""
    decide = sorted(result.decide_s())
    span = max(result.run.ended_s, 1e-9)
    engines = len(result.engines)
    return {"decide_us_p50": statistics.median(decide) * 1e6 if decide else None,
            "decide_us_p99": decide[int(0.99 * (len(decide) - 1))] * 1e6 if decide else None,
            "route_us_p50": statistics.median(result.route_s) * 1e6 if result.route_s else None,
            "iterations_per_s": len(decide) / span,
            "scheduler_utilization": result.scheduler_busy_s / span,
            "engine_wait_fraction": result.engine_wait_s / (engines * span),
            "steals": result.steals}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of `coserve bench cluster project`."""
    ap.add_argument("--json", type=Path, required=True, help="write the results here")
    ap.add_argument("--plots", type=Path, default=None, help="write PNG plots into this folder")
    ap.add_argument("--from", dest="source", type=Path, default=None,
                    help="a `cluster validate` JSON: project engines like the one it measured")
    ap.add_argument("--engine-model", choices=("measured", "a100"), default=None,
                    help="measured (needs --from; the default with it) or a100 (published figures)")
    ap.add_argument("--engines", default="1,2,4,8,16", help="comma-separated engine counts")
    ap.add_argument("--rate-per-engine", type=float, default=None,
                    help="requests/s per engine (default: 1.5 measured, 4 a100)")
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--costs", default="decisions,actor", help=f"scheduler cost models of {sorted(COSTS)}")
    ap.add_argument("--seed", type=int, default=0)


def engine_kind(args: argparse.Namespace) -> EngineKind:
    """The engines `args` ask for.

    Raises:
        ValueError: `measured` without `--from`.
    """
    name = args.engine_model or ("measured" if args.source is not None else "a100")
    if name == "a100":
        return a100_engine()
    if args.source is None:
        raise ValueError("--engine-model measured needs --from VALIDATION.json (coserve bench cluster validate)")
    return measured_engine(json.loads(args.source.read_text()))


def check_arguments(args: argparse.Namespace) -> tuple[EngineKind, list[str], list[int]]:
    """The engines, cost models and engine counts `args` ask for.

    Raises:
        ValueError: `measured` without `--from`, an unknown cost model, or an engine count below 1.
    """
    costs = [c.strip() for c in args.costs.split(",")]
    unknown = [c for c in costs if c not in COSTS]
    if unknown:
        raise ValueError(f"unknown cost models {unknown}: use {sorted(COSTS)}")
    try:
        counts = [int(e) for e in args.engines.split(",")]
    except ValueError:
        raise ValueError(f"--engines must be comma-separated integers, got {args.engines!r}") from None
    if min(counts) < 1:
        raise ValueError(f"--engines must be >= 1, got {args.engines!r}")
    return engine_kind(args), costs, counts


def run_projection(args: argparse.Namespace) -> dict[str, Any]:
    kind, costs, counts = check_arguments(args)
    rate = args.rate_per_engine if args.rate_per_engine is not None else (4.0 if kind.name == "a100" else 1.5)
    rows = []
    for engines in counts:
        for cost in costs:
            row = project_point(kind, engines, rate, args.window_s, cost, args.seed, args.tenants)
            rows.append(row)
            print(f"{kind.name} engines {engines:>3} {cost:>9}: SLO {_fmt(row['slo_attainment'])} (top10 "
                  f"{_fmt(row['slo_attainment_top10_tenants'])})  inference {row['inference_tokens_per_s']:8.0f} "
                  f"fine-tuning {row['finetune_tokens_per_s']:8.0f} tok/s  scheduler {row['decide_us_p50']:.0f} "
                  f"us/iteration, utilization {row['scheduler_utilization']:.2f}, engines waiting "
                  f"{row['engine_wait_fraction']:.3f}  ({row['wall_s']:.0f} s wall)", flush=True)
    from coserve.planner.latency import machine_id

    return {"engine_model": kind.name, "machine": machine_id("cpu"), "rate_per_engine": rate,
            "window_s": args.window_s, "tenants": args.tenants,
            "slo": {"tpot_ms": kind.setup.slo.tpot_s * 1000, "ttft_ms": kind.setup.slo.ttft_s * 1000},
            "actor_token_s": ACTOR_TOKEN_S, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["coserve", *sys.argv[1:]]), "rows": rows}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def run_project_command(args: argparse.Namespace) -> int:
    """Handler of `coserve bench cluster project`."""
    try:
        check_arguments(args)  # a usage error, reported before minutes of work
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = run_projection(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    if args.plots is not None:
        from coserve.bench.cluster_plots import projection_plots

        for path in projection_plots(result, args.plots):
            print(f"wrote {path}")
    return 0
