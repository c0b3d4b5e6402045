"""A fine-tuning job under settings the machine cannot meet, beside chat clients: how long until it finishes.

The issue's hard case: `coserve serve --local --tpot-slo-ms 30 --max-batch-tokens 64` on a real model,
three clients chatting the whole time (each sends its next streamed request when the last one ends),
and the acceptance check's job (16 short rows, 2 epochs, `batch_size` auto) created once the chat is
running. The TPOT SLO is below what one decode iteration takes on a 2-core CPU, so the hybrid share
gives fine-tuning nothing and the job moves on its minimum share alone (`--finetune-min-share`). Under
an SLO the machine can just meet: benchmarks/liveness_share.py. Reported: the job's time to
`succeeded` (or its last step when `--limit-s` runs out), its steps over time, and the chat clients'
TPOT and TTFT (what the floor costs inference) over the same period.

usage: .venv/bin/python benchmarks/liveness_hard.py [--model DIR] [--limit-s 900] [--json OUT]
       [--serve-flag=--finetune-min-share=0.1 ...]
(default model: SmolLM2-135M-Instruct from the cache; the server is a `coserve serve --local` subprocess).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ROWS = [{"messages": [{"role": "user", "content": f"Say the number {i}."},
                      {"role": "assistant", "content": f"The number is {i}."}]} for i in range(16)]
PROMPTS = ["Tell me about the sea.", "Give me three tips for staying healthy.", "Write a haiku about autumn."]
KEY = "sk-alpha-bars"
HARD_FLAGS = ["--tpot-slo-ms", "30", "--max-batch-tokens", "64"]


def chat_loop(oa: Any, model: str, prompt: str, stop: threading.Event, out: list[dict[str, float]]) -> None:
    """Streamed chats one after another until `stop`; each request's TTFT and mean TPOT."""
    while not stop.is_set():
        start = time.perf_counter()
        first, last, tokens = None, start, 0
        stream = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=64, temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
                tokens += 1
        if first is not None and tokens > 1:
            out.append({"end": last, "ttft_s": first - start, "tpot_s": (last - first) / (tokens - 1)})


def run(model: Path, work: Path, limit_s: float, extra_flags: list[str]) -> dict[str, Any]:
    from local_server import serve_subprocess

    tenants = work / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"alpha": {"api_keys": [KEY]}}}))
    with serve_subprocess(model, tenants, work / "data", KEY, [*HARD_FLAGS, *extra_flags]) as (_proc, test_client):
        # The tests' client gives up after 30 s without retrying; on a shared machine a burst of outside
        # load can hold one response that long, and the measurement is the job, not one poll.
        oa = test_client.with_options(timeout=300, max_retries=3)
        base = oa.models.list().data[0].id
        stop, chats = threading.Event(), []
        threads = [threading.Thread(target=chat_loop, args=(oa, base, p, stop, chats), daemon=True)
                   for p in PROMPTS]
        for thread in threads:
            thread.start()
        time.sleep(10)  # the chat is running before the job arrives
        upload = oa.files.create(file=("numbers.jsonl", io.BytesIO("\n".join(map(json.dumps, ROWS)).encode())),
                                 purpose="fine-tune")
        start = time.perf_counter()
        job = oa.fine_tuning.jobs.create(model=base, training_file=upload.id, hyperparameters={"n_epochs": 2})
        trace, total_steps = [], 0
        while job.status not in ("succeeded", "failed", "cancelled") and time.perf_counter() - start < limit_s:
            time.sleep(5)
            job = oa.fine_tuning.jobs.retrieve(job.id)
            metrics = [e.data for e in oa.fine_tuning.jobs.list_events(job.id, limit=5).data
                       if e.type == "metrics" and e.data]
            total_steps = max((m.get("total_steps") or 0 for m in metrics), default=total_steps)
            trace.append({"t_s": round(time.perf_counter() - start, 1), "status": job.status,
                          "step": max((m.get("step", 0) for m in metrics), default=0),
                          "trained_tokens": job.trained_tokens})
            print(f"{trace[-1]['t_s']:6.0f} s  {job.status:9}  step {trace[-1]['step']}", flush=True)
        took = time.perf_counter() - start
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    during = [c for c in chats if 0 <= c["end"] - start <= took]
    return {"status": job.status, "seconds": took, "total_steps": total_steps, "trace": trace,
            "chat_requests": len(during),
            "chat_tpot_ms_median": 1000 * statistics.median(c["tpot_s"] for c in during) if during else None,
            "chat_ttft_ms_median": 1000 * statistics.median(c["ttft_s"] for c in during) if during else None,
            "flags": HARD_FLAGS + extra_flags}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--limit-s", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--serve-flag", action="append", default=[], help="an extra `coserve serve` flag")
    args = parser.parse_args()
    import tempfile

    from coserve.model.known_models import fetch_model

    model = args.model or fetch_model("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(model, Path(tmp), args.limit_s, args.serve_flag)
    print(f"job {result['status']} after {result['seconds']:.0f} s (last step "
          f"{result['trace'][-1]['step'] if result['trace'] else 0} of {result['total_steps']}); chat "
          f"during it: {result['chat_requests']} requests, TPOT median {result['chat_tpot_ms_median']:.0f} ms, "
          f"TTFT median {result['chat_ttft_ms_median']:.0f} ms", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
