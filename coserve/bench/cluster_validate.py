"""`coserve bench cluster validate`: measured 1- and 2-engine runs on this machine against the cluster simulator.

    coserve bench cluster validate [--quick] --json OUT [--plots DIR]

1. Calibrate as the co-serving benchmark does (`coserving.calibrate`: the latency model from a sweep and a
   few seconds of co-serving, the SLOs from the measured decode step), on one engine with one torch
   thread (each engine of the runs gets one thread and, on a 2-core machine, one core).
2. For each per-engine rate: a Poisson trace of `window_s` seconds from 8 tenants at `rate` requests/s
   per engine, one fine-tuning job per engine (the co-serving benchmark's job with shorter examples,
   128-384 tokens, so that optimizer steps complete within the window on a busy machine; placed by the
   cluster),
   replayed against N = 1 and 2 real engines in this process (`cluster_replay`), each on its own thread.
3. Each measured run replayed in the cluster simulator (`simulator.simulate_engines`, the same cluster
   code) with per-engine latency models fitted on the run's own iterations, each engine's loop overhead
   and noise, once per noise seed ("simulated"); and the 2-engine run predicted from the 1-engine run's
   model alone ("predicted from 1 engine": what a projection does).

Reported per run and metric: measured, simulated (and predicted), their relative errors; the target is
15% on throughput and SLO attainment.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from coserve.bench.cluster_run import ClusterRun
from coserve.bench.cluster_sim import JobArrival
from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits, RunRecord
from coserve.bench.run_metrics import relative_error, summarize
from coserve.bench.simulator import (
    EngineShape,
    SimSettings,
    measured_overhead_s,
    simulate_engines,
    truth_model_from_run,
)
from coserve.bench.traces import RequestSpec, make_trace, poisson_arrivals
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.planner.latency import LatencyModel

COMPARED = ("inference_tokens_per_s", "finetune_tokens_per_s", "finetune_steady_tokens_per_s",
            "slo_attainment", "ttft_p50_ms", "tpot_mean_ms")
TARGETS = ("inference_tokens_per_s", "finetune_tokens_per_s", "slo_attainment")  # within 15%
TENANTS = tuple(f"t{i}" for i in range(8))
SIM_SEEDS = 3
SHORT_JOB_TOKENS = (128, 384)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of `coserve bench cluster validate`."""
    ap.add_argument("--quick", action="store_true", help="one rate, 16 s windows, a short sweep")
    ap.add_argument("--json", type=Path, required=True, help="write the results here")
    ap.add_argument("--plots", type=Path, default=None, help="write PNG plots into this folder")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="HF model folder (default: the small preset, created under benchmarks/out)")
    ap.add_argument("--rates", default=None, help="comma-separated requests/s per engine (default 0.5,1)")
    ap.add_argument("--window-s", type=float, default=None, help="arrival window (default 40; quick 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)


def _per_engine(result: ClusterRun, engine_id: str) -> RunRecord:
    run = result.run
    return RunRecord(run.policy, run.rate, run.window_s, [], result.engine_iterations(engine_id), run.num_layers)


def engine_models(result: ClusterRun, fingerprint: Any) -> list[tuple[LatencyModel, SimSettings]]:
    """Per engine of a measured run: the latency model fitted on its own iterations, its loop overhead
    and its noise (`simulator.truth_model_from_run`, `measured_overhead_s`)."""
    out = []
    for engine_id in result.engines:
        single = _per_engine(result, engine_id)
        model, sigma = truth_model_from_run(single, fingerprint)
        out.append((model, SimSettings(overhead_s=measured_overhead_s(single), noise_sigma=sigma)))
    return out


def _simulate(setup: PolicySetup, trace: list[RequestSpec], limits: RunLimits, shape: EngineShape,
              jobs: list[FinetuneJobSpec], engines: list[tuple[LatencyModel, SimSettings]],
              rate: float) -> list[dict[str, Any]]:
    """The run in the simulator once per noise seed; each seed's metrics row."""
    rows = []
    for seed in range(SIM_SEEDS):
        sims = [dataclasses.replace(sim, seed=seed * 101 + i) for i, (_, sim) in enumerate(engines)]
        arrivals = [JobArrival(0.0, dataclasses.replace(j, job_id=f"{j.job_id}-sim{seed}")) for j in jobs]
        result = simulate_engines(make_factory("coserve", setup), trace, limits, [m for m, _ in engines], shape,
                                  jobs=arrivals, sims=sims, policy_name="coserve", rate=rate)
        rows.append(summarize(result.run, setup.slo).to_dict())
    return rows


def _compare(measured: dict[str, Any], simulated: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in COMPARED:
        values = [row[key] for row in simulated if row[key] is not None]
        mean = sum(values) / len(values) if values else None
        error = relative_error(mean, measured[key])
        out[key] = {"measured": measured[key], "simulated": mean,
                    "error": error if math.isfinite(error) else None,
                    "range": [min(values), max(values)] if values else None}
    return out


def _scheduler_stats(result: ClusterRun) -> dict[str, Any]:
    decide = result.decide_s()
    return {"decide_us_p50": statistics.median(decide) * 1e6 if decide else None,
            "decide_us_p99": sorted(decide)[int(0.99 * (len(decide) - 1))] * 1e6 if decide else None,
            "route_us_p50": statistics.median(result.route_s) * 1e6 if result.route_s else None,
            "steals": result.steals,
            "iterations": {e: len(result.engine_iterations(e)) for e in result.engines}}


def _measure_pair(args: argparse.Namespace, engine_config: Any, setup: PolicySetup, job_spec: FinetuneJobSpec,
                  rate: float, window: float, shape: EngineShape, fingerprint: Any) -> list[dict[str, Any]]:
    """The 1- and 2-engine runs at `rate` per engine, each with its simulator check (module docstring)."""
    from coserve.bench.cluster_replay import replay_engines

    limits = RunLimits(window, drain_s=max(setup.slo.ttft_s, 2.0))
    rows, single_engine = [], None
    for n in (1, 2):
        trace = make_trace(poisson_arrivals(rate * n, window, args.seed + n), args.seed + n, tenants=TENANTS,
                           prefix=f"n{n}r")
        jobs = [dataclasses.replace(job_spec, job_id=f"job-{n}-{rate}-{i}", tenant=f"ft{i}",
                                    adapter_id=job_spec.adapter_id + i,
                                    output_dir=f"{job_spec.output_dir}/{n}-{rate}-{i}") for i in range(n)]
        t0, load_before = time.monotonic(), os.getloadavg()[0]
        result = replay_engines([engine_config] * n, make_factory("coserve", setup), trace, limits, jobs=jobs,
                                num_layers=shape.num_layers, policy_name="coserve", rate=rate * n)
        measured = summarize(result.run, setup.slo).to_dict()
        models = engine_models(result, fingerprint)
        row = {"engines": n, "rate_per_engine": rate, "wall_s": time.monotonic() - t0,
               "loadavg_1m": [load_before, os.getloadavg()[0]], "measured": measured,
               "scheduler": _scheduler_stats(result),
               "simulated": _compare(measured, _simulate(setup, trace, limits, shape, jobs, models, rate * n)),
               "engine_models": [m.coefficients for m, _ in models],
               "engine_sims": [dataclasses.asdict(s) for _, s in models]}
        if n == 1:
            single_engine = models[0]
        elif single_engine is not None:
            row["predicted_from_1_engine"] = _compare(
                measured, _simulate(setup, trace, limits, shape, jobs, [single_engine] * n, rate * n))
        rows.append(row)
        print(_row(row), flush=True)
    return rows


def _row(row: dict[str, Any]) -> str:
    parts = [f"engines {row['engines']} rate/engine {row['rate_per_engine']} (load {row['loadavg_1m'][1]:.1f}):"]
    for key in TARGETS:
        cell = row["simulated"][key]
        measured, simulated = cell["measured"], cell["simulated"]
        pred = row.get("predicted_from_1_engine", {}).get(key, {}).get("simulated")
        parts.append(f"{key} measured {_fmt(measured)} simulated {_fmt(simulated)}"
                     + (f" predicted {_fmt(pred)}" if pred is not None else ""))
    return "  ".join(parts)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _short_job(engine: Any, workdir: Path, seed: int) -> FinetuneJobSpec:
    """The co-serving benchmark's job with examples of 128-384 tokens (module docstring)."""
    from transformers import AutoTokenizer

    from coserve.bench.coserving import bench_job_spec

    tokenizer = AutoTokenizer.from_pretrained(str(engine.config.model))
    return bench_job_spec(tokenizer, engine.model_config.num_layers, engine.layout.max_model_len,
                          workdir / "job", seed, SHORT_JOB_TOKENS)


def run_validation(args: argparse.Namespace) -> dict[str, Any]:
    """Everything of the module docstring; returns the JSON document."""
    import torch

    from coserve.bench.calibration import SweepSettings
    from coserve.bench.coserving import QUICK_SWEEP, STALL_MULTIPLE, WARMUP_S, engine_and_job
    from coserve.bench.coserving_setup import calibrate
    from coserve.contract.engine_config import EngineConfig
    from coserve.planner.latency import machine_id

    torch.set_num_threads(1)  # one per engine: every engine thread runs with one
    rates = [float(r) for r in args.rates.split(",")] if args.rates else ([0.5] if args.quick else [0.5, 1.0])
    window = args.window_s if args.window_s is not None else (16.0 if args.quick else 40.0)
    with tempfile.TemporaryDirectory(prefix="coserve-cluster-") as tmp:
        engine, job_spec, model = engine_and_job(args, Path(tmp))
        job_spec = _short_job(engine, Path(tmp), args.seed)
        t0 = time.monotonic()
        setup, fit, _ = calibrate(engine, job_spec, rates[0], args.seed, QUICK_SWEEP if args.quick else SweepSettings(),
                                  WARMUP_S, STALL_MULTIPLE)
        layout, num_layers = engine.layout, engine.model_config.num_layers
        fingerprint = setup.latency.fingerprint
        config = EngineConfig(model=str(engine.config.model), dtype=args.dtype, device=args.device,
                              num_kv_blocks=layout.num_kv_blocks, block_size=layout.block_size,
                              max_loras=layout.num_adapter_slots, max_lora_rank=layout.max_lora_rank, seed=args.seed)
        shape = EngineShape(layout.num_kv_blocks, layout.block_size, layout.num_adapter_slots, layout.vocab_size,
                            num_layers)
        del engine  # the runs build their own engines, each on its thread
        gc.collect()
        print(f"calibrated in {time.monotonic() - t0:.0f} s: SLO TPOT {setup.slo.tpot_s * 1000:.1f} ms, TTFT "
              f"{setup.slo.ttft_s * 1000:.0f} ms, max_num_seqs {setup.scheduler.max_num_seqs}, held-out MAPE "
              f"{fit.heldout_mape:.1f}%", flush=True)
        runs = []
        for rate in rates:
            runs += _measure_pair(args, config, setup, job_spec, rate, window, shape, fingerprint)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"machine": machine_id(args.device), "model": model, "date": date,
            "command": " ".join(["coserve", *sys.argv[1:]]),
            "slo": {"tpot_ms": setup.slo.tpot_s * 1000.0, "ttft_ms": setup.slo.ttft_s * 1000.0},
            "settings": {"window_s": window, "rates_per_engine": rates, "threads_per_engine": 1,
                         "max_num_seqs": setup.scheduler.max_num_seqs, "safety_margin": setup.safety_margin,
                         "max_stall_ms": setup.max_stall_ms, "tenants": len(TENANTS), "sim_seeds": SIM_SEEDS,
                         "seed": args.seed},
            "policy_latency_model": {"coefficients": setup.latency.coefficients,
                                     "heldout_mape_percent": fit.heldout_mape},
            "setup": {"scheduler": dataclasses.asdict(setup.scheduler), "slo": dataclasses.asdict(setup.slo),
                      "safety_margin": setup.safety_margin, "max_stall_ms": setup.max_stall_ms,
                      "fingerprint": dataclasses.asdict(fingerprint)},
            "shape": dataclasses.asdict(shape), "runs": runs}


def run_validate_command(args: argparse.Namespace) -> int:
    """Handler of `coserve bench cluster validate`."""
    result = run_validation(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    print(f"wrote {args.json}")
    if args.plots is not None:
        from coserve.bench.cluster_plots import validation_plot

        print(f"wrote {validation_plot(result, args.plots)}")
    return 0
