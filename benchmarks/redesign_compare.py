"""Issue 17's redesign against the main before it: the engine benchmark and the co-serving benchmark
of several trees, run alternately in one run, so that the drift of a shared machine hits them alike.

usage (from the repository root, with checkouts of the trees to compare beside it)::

    git worktree add --detach ../coserve-before-17 7769e5c
    .venv/bin/python benchmarks/redesign_compare.py --baseline before=../coserve-before-17 --rounds 3 \\
        --json benchmarks/out/redesign_compare.json

`--baseline NAME=DIR` may be given more than once (e.g. the main before the redesign, and that main
plus an engine change merged beside the redesign, to tell the two apart).

Each round runs, for each tree in turn (the order rotates every round), in a fresh subprocess with
that tree on `PYTHONPATH`:

- engine: that tree's `benchmarks/_bench_arms.py coserve` on one spec: `engine_throughput.py`'s
  workload (32 prompts of 48-80 tokens, 64 greedy tokens each, half through a rank-16 LoRA, the
  `small` llama), `LLM.generate` tokens/s; the greedy outputs of the trees must be equal;
- co-serving: that tree's `coserve bench co-serving --quick` (its short calibration sweep) with one
  policy, one rate, a 40 s window and the SLOs given (not calibrated, so every tree plans for the same
  SLO): fine-tuning tokens/s (window and steady), inference tokens/s, SLO attainment, TPOT p99, TTFT p50.

The report gives each figure per tree (median over rounds) and the per-round ratios current/baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import engine_throughput  # noqa: E402  (the engine benchmark's workload)

COSERVING_FIGURES = ("finetune_tokens_per_s", "finetune_steady_tokens_per_s", "inference_tokens_per_s",
                     "slo_attainment", "tpot_p99_ms", "ttft_p50_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", action="append", required=True, metavar="NAME=DIR",
                    help="a tree to compare with (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads (default 2)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-coserving", action="store_true")
    ap.add_argument("--policy", default="coserve", help="co-serving policy (default coserve, the hybrid)")
    ap.add_argument("--rate", default="2", help="co-serving request rate (default 2/s)")
    ap.add_argument("--tpot-slo-ms", type=float, default=80.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=3200.0)
    ap.add_argument("--window-s", type=float, default=40.0,
                    help="co-serving arrival window (40 s: a 16 s window holds a handful of optimizer steps)")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def _env(tree: Path, threads: int) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def run_engine(tree: Path, spec_path: Path, threads: int, out: Path) -> dict[str, Any]:
    """One timed `LLM.generate` of the workload with `tree`'s coserve."""
    cmd = [sys.executable, str(tree / "benchmarks" / "_bench_arms.py"), "coserve", "--spec", str(spec_path),
           "--out", str(out)]
    subprocess.run(cmd, env=_env(tree, threads), check=True, cwd=tree, timeout=3600)
    return json.loads(out.read_text())


def run_coserving(tree: Path, args: argparse.Namespace, model_dir: Path, out: Path) -> dict[str, Any]:
    """`coserve bench co-serving` of `tree` on `model_dir`: the run of the policy at the rate."""
    cmd = [sys.executable, "-m", "coserve.cli", "bench", "co-serving", "--quick", "--json", str(out),
           "--model-dir", str(model_dir),
           "--threads", str(args.threads), "--policies", args.policy, "--rates", args.rate,
           "--tpot-slo-ms", str(args.tpot_slo_ms), "--ttft-slo-ms", str(args.ttft_slo_ms),
           "--window-s", str(args.window_s)]
    subprocess.run(cmd, env=_env(tree, args.threads), check=True, cwd=tree, timeout=7200,
                   stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    (run,) = [r for r in result["runs"] if r["policy"] == args.policy]  # the Poisson trace's run
    return {**{key: run[key] for key in COSERVING_FIGURES},
            "finetune_only_tokens_per_s": result["finetune_only_tokens_per_s"],
            "max_num_seqs": result["settings"]["max_num_seqs"]}


def one_round(index: int, trees: dict[str, Path], args: argparse.Namespace, spec_path: Path,
              model_dir: Path, tmp: Path) -> dict[str, dict[str, Any]]:
    names = list(trees)
    order = names[index % len(names):] + names[:index % len(names)]  # each tree goes first in turn
    results: dict[str, dict[str, Any]] = {name: {} for name in trees}
    for name in order:
        if not args.skip_engine:
            results[name]["engine"] = run_engine(trees[name], spec_path, args.threads,
                                                 tmp / f"e-{name}-{index}.json")
            print(f"round {index + 1} {name}: engine {results[name]['engine']['tokens_per_s']:.1f} tok/s",
                  flush=True)
    for name in order:
        if not args.skip_coserving:
            results[name]["coserving"] = run_coserving(trees[name], args, model_dir, tmp / f"c-{name}-{index}.json")
            print(f"round {index + 1} {name}: co-serving {results[name]['coserving']}", flush=True)
    return results


def summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per figure: each tree's median over rounds and the per-round current/baseline ratios."""
    out: dict[str, Any] = {}
    names = list(rounds[0])
    figures = [("engine", "tokens_per_s")] + [("coserving", key) for key in COSERVING_FIGURES]
    for part, key in figures:
        if part not in rounds[0]["current"]:
            continue
        values = {name: [r[name][part][key] for r in rounds] for name in names}
        row: dict[str, Any] = {name: statistics.median(v) for name, v in values.items() if None not in v}
        for name in names[:-1]:
            row[f"current/{name}"] = [c / b for b, c in zip(values[name], values["current"]) if b and c is not None]
        out[f"{part}.{key}"] = row
    if "engine" in rounds[0]["current"]:
        out["engine.same_outputs"] = all(len({json.dumps(r[n]["engine"]["outputs"]) for n in names}) == 1
                                         for r in rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = {name: Path(path).resolve() for name, _, path in (b.partition("=") for b in args.baseline)}
    trees["current"] = ROOT
    # engine_throughput's own defaults (its workload: half the rows through the adapter), our threads.
    spec_args = engine_throughput.parse_args(["--threads", str(args.threads)])
    model_dir, _ = engine_throughput.ensure_model(None)
    spec = engine_throughput.build_spec(spec_args, model_dir)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="coserve-redesign-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        rounds = [one_round(i, trees, args, spec_path, model_dir, Path(tmp)) for i in range(args.rounds)]
    kept = [{n: {p: {k: v for k, v in d.items() if k != "outputs"} for p, d in r[n].items()} for n in r}
            for r in rounds]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"
    result = {"summary": summary(rounds), "rounds": kept,
              "meta": {"started": started, "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "trees": {name: str(path) for name, path in trees.items()}, "machine": machine,
                       "command": " ".join(sys.argv), "threads": args.threads, "policy": args.policy,
                       "rate": args.rate, "slo_ms": [args.tpot_slo_ms, args.ttft_slo_ms],
                       "window_s": args.window_s}}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
