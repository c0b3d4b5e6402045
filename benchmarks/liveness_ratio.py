"""Fine-tuning alone vs the same job on an idle server: the liveness ratio (issue: fine-tuning never starves).

The idle server must give a job the whole iteration (`max_batch_tokens`), so a job runs at >= 90% of the
speed of fine-tuning alone on the same engine. Side by side, alternating, in one process:

- alone: `coserve.LLM(...).fine_tune(rows)` (the offline driver: one engine, no server);
- idle server: `coserve serve --local`'s app with the same model and limits (uvicorn in a thread), the
  same rows uploaded and trained through the official client, timed from create to `succeeded`.

Each arm runs in a fresh subprocess (`--arm alone|server`), alternating: torch keeps per-thread state
(OpenMP teams), so two arms in one process would measure each other's leftovers.

usage: .venv/bin/python benchmarks/liveness_ratio.py [--model DIR] [--rounds 3] [--json OUT]
(default model: a tiny random llama, small preset, made in a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ROWS = [{"messages": [{"role": "user", "content": f"Say the number {i} in words, please."},
                      {"role": "assistant", "content": f"The number you asked for is {i}. Have a good day!"}]}
        for i in range(20)]
HYPER = {"n_epochs": 4, "batch_size": 4}
LIMITS = {"max_num_seqs": 64, "max_batch_tokens": 2048}


def alone(model: Path, out: Path) -> float:
    from coserve import LLM

    llm = LLM(model=str(model), dtype="float32", **LIMITS)
    start = time.perf_counter()
    llm.fine_tune(ROWS, str(out), hyperparameters=HYPER)
    return time.perf_counter() - start


def on_idle_server(model: Path, root: Path) -> float:
    from local_server import local_server, poll_job, upload_jsonl

    root.mkdir(parents=True)
    with local_server(model, root, {"bench": {"api_keys": ["sk-bench"]}}, **LIMITS) as srv:
        oa = srv.client("sk-bench")
        file_id = upload_jsonl(oa, ROWS)
        start = time.perf_counter()
        job = oa.fine_tuning.jobs.create(model=srv.base, training_file=file_id, hyperparameters=HYPER)
        job = poll_job(oa, job.id, timeout=3600, interval=0.25)
        took = time.perf_counter() - start
    if job.status != "succeeded":
        raise RuntimeError(f"the server's job ended {job.status}")
    return took


def _arm(arm: str, model: Path, work: Path) -> float:
    """One arm in a fresh process; returns its seconds."""
    out = subprocess.run([sys.executable, __file__, "--arm", arm, "--model", str(model), "--work", str(work)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--arm", choices=("alone", "server"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm is not None:  # a child: run one arm, print its seconds last
        print(alone(args.model, args.work) if args.arm == "alone" else on_idle_server(args.model, args.work))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from coserve.model.tiny_model import create_tiny_model

            model = create_tiny_model(work / "tiny-llama", arch="llama", preset="small", seed=0)
        rows = []
        for k in range(args.rounds):  # alternating, so a slow phase of the machine hits both arms
            a = _arm("alone", model, work / f"alone-{k}")
            s = _arm("server", model, work / f"server-{k}")
            rows.append({"alone_s": a, "server_s": s, "ratio": a / s})
            print(f"round {k}: alone {a:.2f} s, idle server {s:.2f} s, speed ratio {a / s:.3f}", flush=True)
    ratios = sorted(r["ratio"] for r in rows)
    print(f"median speed of the idle server's job vs fine-tuning alone: {ratios[len(ratios) // 2]:.3f} "
          f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f}; >= 0.9 is the target)")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "rounds": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
