"""A job's time beside a continuous chat flood under an SLO the machine can just meet, against its time alone:
the minimum share's bound (issue 34: at most its time alone / `--finetune-min-share` x 1.5).

Three phases on SmolLM2 (`coserve serve --local` subprocesses, the chat of benchmarks/liveness_hard.py:
three clients streaming 64-token replies, each sending its next request when the last one ends, started
`STAGGER_S` apart so that their requests do not all end in one iteration: with a gap where none runs,
the engine would give fine-tuning whole iterations and the flood would not be continuous):

1. probe: a server with the default SLO and the three clients alone for `--probe-s` seconds; their median
   time per output token is one decode iteration of three sequences on this machine;
2. alone: a server with `--tpot-slo-ms` just above that (`--slo-factor` x the decode iteration, over the
   policy's 10% safety margin), the job (16 rows, `--epochs`) created on it idle: its time alone;
3. flood: on the same server, the three clients chat, and 10 s later the same job again: its time under
   the flood, the chat's TPOT and TTFT meanwhile;
4. control (with `--control-share S`): phase 3 again on a fresh server with `--finetune-min-share S` (0.001:
   the floor all but off), so the chat's TPOT with and without the 5% floor compare under one SLO.

Reported: both times, their ratio against the bound 1.5 / share, and the chat's latencies (what the share
costs the SLO).

usage: .venv/bin/python benchmarks/liveness_share.py [--model DIR] [--epochs 1] [--slo-factor 1.0]
       [--probe-s 30] [--control-share 0.001] [--limit-s 1500] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from liveness_hard import KEY, PROMPTS, ROWS, chat_loop  # noqa: E402

SHARE = 0.05  # `coserve serve`'s default --finetune-min-share
SAFETY_MARGIN = 0.1  # CoServingConfig's: an iteration is planned up to the SLO minus 10%
STAGGER_S = 2.0  # between the chat clients' starts (a 64-token reply takes about 5 s on 2 cores)


def _chatting(oa: Any, base: str) -> tuple[threading.Event, list[dict[str, float]], list[threading.Thread]]:
    """Start the three chat clients; returns their stop flag, their requests' timings and their threads."""
    stop, chats = threading.Event(), []
    threads = [threading.Thread(target=chat_loop, args=(oa, base, p, stop, chats), daemon=True) for p in PROMPTS]
    for thread in threads:
        thread.start()
        time.sleep(STAGGER_S)
    return stop, chats, threads


def _stop(stop: threading.Event, threads: list[threading.Thread]) -> None:
    stop.set()
    for thread in threads:
        thread.join(timeout=120)


def _job_seconds(oa: Any, base: str, epochs: int, limit_s: float) -> tuple[str, float]:
    """Upload the rows, create the job, poll it to its end (or `limit_s`); its status and seconds."""
    from local_server import upload_jsonl

    file_id = upload_jsonl(oa, ROWS)
    start = time.perf_counter()
    job = oa.fine_tuning.jobs.create(model=base, training_file=file_id, hyperparameters={"n_epochs": epochs})
    while job.status not in ("succeeded", "failed", "cancelled") and time.perf_counter() - start < limit_s:
        time.sleep(1.0)
        job = oa.fine_tuning.jobs.retrieve(job.id)
    took = time.perf_counter() - start
    print(f"  job {job.status} after {took:.1f} s", flush=True)
    return job.status, took


def _median_ms(rows: list[dict[str, float]], key: str) -> float | None:
    return 1000 * statistics.median(r[key] for r in rows) if rows else None


def probe(model: Path, work: Path, seconds: float) -> float:
    """The chat's median TPOT (ms) on a server with the default SLO and no job."""
    from local_server import serve_subprocess

    tenants = work / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"alpha": {"api_keys": [KEY]}}}))
    with serve_subprocess(model, tenants, work / "probe-data", KEY) as (_proc, client):
        oa = client.with_options(timeout=300, max_retries=3)
        base = oa.models.list().data[0].id
        stop, chats, threads = _chatting(oa, base)
        time.sleep(seconds)
        _stop(stop, threads)
    tpot = _median_ms(chats[2:], "tpot_s")  # the first requests warm the server up
    assert tpot is not None, "no chat request finished in the probe"
    print(f"probe: {len(chats)} chat requests, TPOT median {tpot:.1f} ms", flush=True)
    return tpot


def _flood(oa: Any, base: str, epochs: int, limit_s: float) -> dict[str, Any]:
    """The job beside the three chatting clients: its status and seconds, the chat's latencies meanwhile."""
    stop, chats, threads = _chatting(oa, base)
    time.sleep(10)  # the chat is running before the job arrives
    start = time.perf_counter()
    status, took = _job_seconds(oa, base, epochs, limit_s)
    _stop(stop, threads)
    during = [c for c in chats if 0 <= c["end"] - start <= took]
    tpots = sorted(c["tpot_s"] for c in during)
    return {"flood_status": status, "flood_s": took, "chat_requests": len(during),
            "chat_tpot_ms_median": _median_ms(during, "tpot_s"), "chat_ttft_ms_median": _median_ms(during, "ttft_s"),
            "chat_tpot_ms_p90": 1000 * tpots[int(0.9 * (len(tpots) - 1))] if tpots else None}


def measure(model: Path, work: Path, slo_ms: float, epochs: int, limit_s: float, share: float,
            alone: bool = True) -> dict[str, Any]:
    """The job alone (unless not `alone`), then beside the chat, on one server with `--tpot-slo-ms slo_ms`
    and `--finetune-min-share share`."""
    from local_server import serve_subprocess

    flags = ["--tpot-slo-ms", f"{slo_ms:.1f}", "--finetune-min-share", str(share)]
    result: dict[str, Any] = {"slo_ms": slo_ms, "epochs": epochs, "min_share": share}
    with serve_subprocess(model, work / "tenants.yaml", work / f"data-{share}", KEY, flags) as (_proc, client):
        oa = client.with_options(timeout=300, max_retries=3)
        base = oa.models.list().data[0].id
        if alone:
            print(f"alone ({' '.join(flags)}):", flush=True)
            result["alone_status"], result["alone_s"] = _job_seconds(oa, base, epochs, limit_s)
        print(f"beside three chatting clients ({' '.join(flags)}):", flush=True)
        result.update(_flood(oa, base, epochs, limit_s))
    if alone:
        result["bound_s"] = 1.5 * result["alone_s"] / share
        result["ratio_to_bound"] = result["flood_s"] / result["bound_s"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--slo-factor", type=float, default=1.0,
                        help="the SLO's budget (SLO minus the 10%% margin) over one decode iteration")
    parser.add_argument("--probe-s", type=float, default=30.0)
    parser.add_argument("--control-share", type=float, default=None,
                        help="also run the flood on a server with this --finetune-min-share (e.g. 0.001)")
    parser.add_argument("--limit-s", type=float, default=1500.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from coserve.model.known_models import fetch_model

    model = args.model or fetch_model("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        decode_ms = probe(model, work, args.probe_s)
        slo_ms = decode_ms * args.slo_factor / (1 - SAFETY_MARGIN)
        result = {"decode_iteration_ms": decode_ms,
                  **measure(model, work, slo_ms, args.epochs, args.limit_s, SHARE)}
        if args.control_share is not None:
            result["control"] = measure(model, work, slo_ms, args.epochs, args.limit_s, args.control_share,
                                        alone=False)
    print(f"job alone {result['alone_s']:.1f} s, beside the chat {result['flood_s']:.1f} s: "
          f"{result['flood_s'] / result['alone_s']:.1f}x (the bound: 1.5 / {SHARE} = {1.5 / SHARE:.0f}x, "
          f"{result['ratio_to_bound']:.2f} of it); chat TPOT median {result['chat_tpot_ms_median']:.0f} ms "
          f"(SLO {slo_ms:.0f} ms), TTFT median {result['chat_ttft_ms_median']:.0f} ms", flush=True)
    if "control" in result:
        control = result["control"]
        print(f"control (--finetune-min-share {args.control_share}): job beside the chat {control['flood_s']:.1f} s, "
              f"chat TPOT median {control['chat_tpot_ms_median']:.0f} ms, TTFT median "
              f"{control['chat_ttft_ms_median']:.0f} ms", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
