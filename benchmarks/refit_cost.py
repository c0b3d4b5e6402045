"""The scheduler's decision CPU with the online latency refit of two trees, side by side.

The cluster projection (`coserve bench cluster project`) found 86% of the central scheduler's CPU per
engine iteration in `LatencyModel.observe`, whose constrained solve ran on ~73% of iterations. This runs
the projection's point of that finding, `project_point(a100_engine(), 8, 3.0, 10.0, "decisions", 0)` (8
A100-class engines, 3 requests/s each, 10 s, 1000 tenants), once per tree per round, each in a fresh
subprocess with that tree on `PYTHONPATH`, the trees alternating. The simulated engines' times come from
the model (no torch), so what differs between the trees is the scheduler's CPU alone; the decisions, and
so attainment and fine-tuning tokens, must come out the same.

usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/refit_cost.py --baseline DIR [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json
from coserve.bench.cluster_projection import a100_engine, project_point
row = project_point(a100_engine(), 8, 3.0, 10.0, "decisions", 0)
print(json.dumps({"decide_us_p50": row["decide_us_p50"], "decide_us_p99": row["decide_us_p99"],
                  "scheduler_utilization": row["scheduler_utilization"], "slo_attainment": row["slo_attainment"],
                  "finetune_tokens_per_s": row["finetune_tokens_per_s"]}))
"""


def run_tree(tree: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin",
                                                                       "OMP_NUM_THREADS": "1"},
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the tree to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    trees = {"baseline": args.baseline.resolve(), "current": ROOT}
    rounds: list[dict[str, Any]] = []
    for k in range(args.rounds):
        order = list(trees) if k % 2 == 0 else list(reversed(trees))
        row = {name: run_tree(trees[name]) for name in order}
        rounds.append(row)
        for name in trees:
            r = row[name]
            print(f"round {k} {name:8s}: decision p50 {r['decide_us_p50']:.0f} us, p99 {r['decide_us_p99']:.0f} us, "
                  f"scheduler busy {r['scheduler_utilization']:.2f}, attainment {r['slo_attainment']:.3f}, "
                  f"fine-tuning {r['finetune_tokens_per_s']:.0f} tok/s", flush=True)
    ratio = [r["current"]["decide_us_p50"] / r["baseline"]["decide_us_p50"] for r in rounds]
    print(f"decision CPU p50, current / baseline: median {statistics.median(ratio):.2f} "
          f"({', '.join(f'{x:.2f}' for x in ratio)})")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "baseline": str(trees["baseline"]), "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
