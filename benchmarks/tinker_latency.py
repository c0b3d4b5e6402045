"""The Tinker API's round trip: a batch-1 `forward_backward` of a few hundred tokens, then `optim_step`,
through the official `tinker` SDK against a local server, on an idle server and under chat load.

Each call's time is split three ways: `queued` (in the scheduler, behind the run's earlier calls),
`compute` (from its first planned work to its outcome, over `iterations` engine steps) and `http` (the
rest of the client's round trip: the SDK, HTTP, the future's polling). The server reports the first two
in each outcome's metrics (`coserve/queued_s`, `coserve/compute_s`, `coserve/iterations`). Under load,
`--clients` chat clients stream replies without pause, and their time per output token is reported
beside the SLO the hybrid policy keeps.

usage (from the repository root)::

    .venv/bin/python benchmarks/tinker_latency.py --model ~/.cache/coserve/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from local_server import LocalServer, local_server  # noqa: E402

KEY = "tml-bench-0123456789"
METRICS = ("coserve/queued_s:max", "coserve/compute_s:max", "coserve/iterations:max")


def one_round(training: Any, tokens: list[int]) -> dict[str, float]:
    """forward_backward then optim_step, each waited for; the client's and the server's times."""
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                                        "weights": np.ones(len(tokens) - 1, np.float32)})
    out: dict[str, float] = {}
    start = time.perf_counter()
    fwd = training.forward_backward([datum], "cross_entropy").result()
    middle = time.perf_counter()
    step = training.optim_step(types.AdamParams(learning_rate=1e-5)).result()
    end = time.perf_counter()
    for name, metrics, took in (("fwdbwd", fwd.metrics, middle - start), ("optim", step.metrics, end - middle)):
        queued, compute, iterations = (float(metrics[m]) for m in METRICS)
        out |= {f"{name}_s": took, f"{name}_queued_s": queued, f"{name}_compute_s": compute,
                f"{name}_iterations": iterations, f"{name}_http_s": max(0.0, took - queued - compute)}
    out["round_s"] = end - start
    return out


class ChatLoad:
    """`clients` threads streaming chat replies back to back; their time per output token."""

    def __init__(self, server: LocalServer, clients: int, max_tokens: int) -> None:
        self._server, self._max_tokens = server, max_tokens
        self._stop = threading.Event()
        self.tpot_s: list[float] = []
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> ChatLoad:
        for thread in self._threads:
            thread.start()
        time.sleep(2.0)  # every client is streaming
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _run(self, i: int) -> None:
        client = self._server.client(KEY)
        while not self._stop.is_set():
            stamps = []
            stream = client.chat.completions.create(
                model=self._server.base, max_tokens=self._max_tokens, stream=True, temperature=0.7, seed=i,
                messages=[{"role": "user", "content": f"Tell me a long story about the number {i}."}])
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.perf_counter())
            if len(stamps) > 2:
                self.tpot_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))


def summarize(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The median of each figure over the rounds."""
    return {key: round(statistics.median(r[key] for r in rounds), 4) for key in rounds[0]}


def measure(server: LocalServer, tokens: int, repeats: int, clients: int) -> dict[str, Any]:
    sequence = [int(t) for t in np.random.default_rng(0).integers(100, 40000, size=tokens + 1)]
    service = tinker.ServiceClient(base_url=f"{server.url}/tinker", api_key=KEY)
    try:
        training = service.create_lora_training_client(base_model=server.base, rank=16).result()
        one_round(training, sequence)  # warm up: the run's adapter is placed, the first step compiled
        idle = summarize([one_round(training, sequence) for _ in range(repeats)])
        with ChatLoad(server, clients, 96) as load:
            loaded = summarize([one_round(training, sequence) for _ in range(repeats)])
        tpot = sorted(load.tpot_s)
        chat = {"streams": len(tpot), "tpot_p50_ms": round(1000 * tpot[len(tpot) // 2], 1) if tpot else None,
                "tpot_p90_ms": round(1000 * tpot[int(len(tpot) * 0.9)], 1) if tpot else None}
    finally:
        service.close("success").result()
    return {"idle": idle, "under_chat_load": loaded, "chat": chat}


def main() -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/coserve/models/smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help="the server's TPOT SLO (default: its own)")
    args = parser.parse_args()
    header = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "tokens": args.tokens,
              "repeats": args.repeats, "clients": args.clients}
    options: dict[str, Any] = {"kv_cache_memory_gb": 0.5}
    if args.tpot_slo_ms is not None:
        options["tpot_slo_ms"] = args.tpot_slo_ms
    with tempfile.TemporaryDirectory() as root, \
            local_server(args.model, Path(root), {"bench": {"api_keys": [KEY]}}, **options) as server:
        result = measure(server, args.tokens, args.repeats, args.clients)
    header["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    print(json.dumps({**header, **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
