"""Where a co-serving run's time goes: a benchmark JSON's setup replayed in the simulator, per policy.

    .venv/bin/python benchmarks/coserving_breakdown.py benchmarks/out/coserving_quick.json \
        [--window-s 40] [--policies coserve,coserve-strict,temporal-n16]

Takes the SLOs, scheduler limits, margins, stall cap and fitted latency model that `coserve bench
co-serving` wrote, rebuilds its fine-tuning job, and simulates fine-tuning alone and each policy at each
of the JSON's rates (Poisson, the benchmark's seed). For every run it prints the fine-tuning throughput
and how the window splits between inference-only, fine-tuning-only and mixed iterations (their count,
share of the window and mean length), and the share the model's per-iteration constant takes. The
simulator reproduces measured throughputs within ~8% (`simulator_check` in the JSON), so the split is
that of the measured runs up to that error; it is cheap (seconds) where a measured run takes minutes.

For coserve it also prints the bounds (`headroom`, `slo_bound`), and for every policy its pacing
(`pacing`: iterations per TPOT SLO while requests were live, and their constants). `--scale NAME=F`
multiplies a fitted coefficient by F (repeatable), e.g. `--scale constant=0.5`: what each policy and
the bounds would be on an engine whose per-iteration constant were half as large.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from coserve.bench.coserving import MAX_BATCH_TOKENS, NUM_KV_BLOCKS, against_bounds, bench_job_spec
from coserve.bench.coserving_rows import pacing_line
from coserve.bench.pacing import pacing
from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits, RunRecord
from coserve.bench.run_metrics import SLO, summarize
from coserve.bench.simulator import EngineShape, simulate
from coserve.bench.traces import make_trace, poisson_arrivals
from coserve.bench.trainer import ensure_model
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel, ModelFingerprint

BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096  # the small preset's max_position_embeddings, the engine's limit


def setup_from(result: dict, scale: dict[str, float] | None = None) -> PolicySetup:
    """The policies' setup a benchmark JSON describes, its fitted coefficients multiplied by `scale`'s
    factors (by name)."""
    settings = result["settings"]
    coefficients = {name: value * (scale or {}).get(name, 1.0)
                    for name, value in result["latency_model"]["coefficients"].items()}
    latency = LatencyModel(ModelFingerprint("bench", "json", "float32"), coefficients)
    slo = SLO(ttft_s=result["slo"]["ttft_ms"] / 1000.0, tpot_s=result["slo"]["tpot_ms"] / 1000.0)
    scheduler = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=settings["max_num_seqs"],
                                max_batch_tokens=MAX_BATCH_TOKENS, block_size=BLOCK_SIZE)
    return PolicySetup(scheduler=scheduler, slo=slo, latency=latency, safety_margin=settings["safety_margin"],
                       max_stall_ms=settings["max_stall_ms"],
                       strict_safety_margin=settings["strict_safety_margin"],
                       # runs before 2026-11-28 banked against the safety margin
                       burst_margin=settings.get("burst_margin", settings["safety_margin"]))


def split(run: RunRecord, constant_s: float) -> str:
    """One line: the window's inference-only / fine-tuning-only / mixed iterations and the constant."""
    kinds = {"inference": [0, 0.0], "fine-tuning": [0, 0.0], "mixed": [0, 0.0]}
    for iteration in run.iterations:
        if iteration.start_s >= run.window_s:
            continue
        f = iteration.features
        finetune, inference = f.ft_forward_tokens or f.ft_backward_token_layers, f.num_sequences
        kind = "mixed" if finetune and inference else "fine-tuning" if finetune else "inference"
        kinds[kind][0] += 1
        kinds[kind][1] += iteration.end_s - iteration.start_s
    count = sum(n for n, _ in kinds.values())
    parts = [f"{kind} {n} its {100 * s / run.window_s:4.1f}% (mean {1000 * s / max(n, 1):5.1f} ms)"
             for kind, (n, s) in kinds.items()]
    return " | ".join(parts) + f" | constant {100 * count * constant_s / run.window_s:4.1f}%"


def _scale(pairs: list[str]) -> dict[str, float]:
    """`--scale NAME=F` arguments as {name: factor}."""
    out = {}
    for pair in pairs:
        name, _, factor = pair.partition("=")
        out[name] = float(factor)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--window-s", type=float, default=None, help="default: the JSON's window")
    ap.add_argument("--policies", default="coserve,coserve-strict,temporal-n16")
    ap.add_argument("--burst-margin", type=float, default=None, help="default: the JSON's")
    ap.add_argument("--scale", action="append", default=[], metavar="NAME=F",
                    help="multiply the fitted coefficient NAME by F (repeatable)")
    args = ap.parse_args()
    result = json.loads(args.json.read_text())
    setup, settings = setup_from(result, _scale(args.scale)), result["settings"]
    if args.burst_margin is not None:
        setup = dataclasses.replace(setup, burst_margin=args.burst_margin)
    window = args.window_s or settings["window_s"]
    model_dir, _ = ensure_model(None)  # the small preset, as the benchmark's default
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    spec = bench_job_spec(tokenizer, config["num_hidden_layers"], MAX_MODEL_LEN, Path(tempfile.mkdtemp()),
                          settings["seed"])
    shape = EngineShape(NUM_KV_BLOCKS, BLOCK_SIZE, 2, config["vocab_size"], spec.num_layers)
    constant = setup.latency.coefficients.get("constant", 0.0)
    runs = [(0.0, "coserve")] + [(rate, p) for rate in settings["rates"] for p in args.policies.split(",")]
    solo: RunRecord | None = None
    for rate, policy in runs:
        trace = make_trace(poisson_arrivals(rate, window, settings["seed"]), settings["seed"]) if rate else []
        run = simulate(make_factory(policy, setup), trace, RunLimits(window, 3.0 if rate else 0.0),
                       setup.latency, shape, job_spec=dataclasses.replace(spec, job_id=f"{policy}-{rate}"),
                       policy_name=policy, rate=rate)
        m = summarize(run, setup.slo)
        name = policy if rate else "fine-tuning only"
        print(f"rate {rate:<4} {name:>16}: fine-tuning {m.finetune_tokens_per_s:6.1f} tok/s (steady "
              f"{m.finetune_steady_tokens_per_s or 0.0:6.1f}) | {split(run, constant)} | TPOT p99 "
              f"{m.tpot_p99_ms or 0.0:.0f} ms, attainment {m.slo_attainment}")
        if solo is None:
            solo, alone = run, max(m.finetune_tokens_per_s, m.finetune_steady_tokens_per_s or 0.0)
            continue
        if policy == "coserve":  # the bounds, the gap by term and the pacing
            against_bounds(run, solo, setup, alone, {"runs": [], "headroom": [], "gap_breakdown": []})
        else:
            print(pacing_line(pacing(run, setup.slo.tpot_s, constant)))


if __name__ == "__main__":
    main()
