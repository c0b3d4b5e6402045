"""The hybrid share's backward budget priced with a piece per layer it spans (now) against one piece (before),
side by side in one process: one calibration, one trace, the two alternating run by run.

    .venv/bin/python benchmarks/backward_pricing_ab.py --model-dir ~/.cache/coserve/models/smollm2-135m-instruct \
        --rates 1.0 --policies coserve-strict,coserve --window-s 30 --threads 2 --finetune-tokens 48,160 --pairs 2

The arguments are `coserve bench co-serving`'s (the first rate is used). "before" swaps the planner's
`backward_within` for one that is not told the job's layers, which prices the whole budget as one piece.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import coserve.planner.hybrid as hybrid
from coserve.bench import coserving
from coserve.bench.calibration import SweepSettings
from coserve.bench.coserving_setup import calibrate, run_policy
from coserve.bench.replay import RunLimits
from coserve.bench.run_metrics import summarize
from coserve.bench.traces import make_trace, poisson_arrivals
from coserve.planner.backward_layers import backward_within
from coserve.planner.latency import LatencyModel, PlanFeatures


def one_piece(latency: LatencyModel, base: PlanFeatures, planned: tuple[int, int, int], budget_s: float,
              layers: tuple[int, int], cap: int) -> int:
    """The pricing before: the job's layers unknown, the budget one piece."""
    return backward_within(latency, base, planned, budget_s, (0, 0), cap)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    coserving.add_arguments(ap)
    ap.add_argument("--pairs", type=int, default=2, help="runs of each variant per policy")
    args = ap.parse_args(sys.argv[1:] + ["--json", "/dev/null"])
    torch.set_num_threads(args.threads or torch.get_num_threads())
    rates, policies, window = coserving._settings(args)
    rate = rates[0]
    with tempfile.TemporaryDirectory() as tmp:
        job = coserving.bench_job(args, Path(tmp))
        sweep = coserving.QUICK_SWEEP if args.quick else SweepSettings()
        setup, _, _ = calibrate(job.engine, job.calibration_spec, rate, args.seed, sweep,
                                min(coserving.WARMUP_S, window), args.stall_multiple, None)
        print(f"TPOT SLO {setup.slo.tpot_s * 1000:.1f} ms, rate {rate}", flush=True)
        limits = RunLimits(window, drain_s=max(setup.slo.ttft_s, 2.0))
        trace = make_trace(poisson_arrivals(rate, window, args.seed), args.seed)
        for pair in range(args.pairs):
            for policy in policies:
                for variant, pricing in (("now", backward_within), ("before", one_piece)):
                    vars(hybrid)["backward_within"] = pricing  # the A/B's one swap: the name the planner calls
                    record = run_policy(job.engine, setup, job.spec, policy, rate, trace, limits,
                                        f"{policy}-{variant}-{pair}")
                    m = summarize(record, setup.slo)
                    print(f"pair {pair} {policy:>15} {variant:>6}: fine-tuning {m.finetune_tokens_per_s:6.1f} tok/s, "
                          f"attainment {m.slo_attainment:.2f}, TPOT p50/p99 {m.tpot_p50_ms:.0f}/{m.tpot_p99_ms:.0f} ms",
                          flush=True)
        vars(hybrid)["backward_within"] = backward_within


if __name__ == "__main__":
    main()
