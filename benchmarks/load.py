"""Load: many concurrent streaming chat clients against a real `coserve serve`, a fine-tuning job training.

    .venv/bin/python benchmarks/load.py [--ray [--engines N]] [--clients 64] [--duration-s 60] [--json OUT]

Starts `coserve serve` on the tiny model (`--local` unless `--ray`; `--engines N` engine actors under the one
scheduler, on Ray) as a subprocess, uploads a chat
dataset and starts a fine-tuning job (enough epochs to train through the whole run), then runs
`--clients` clients, each sending one streamed chat completion after another with the official
`openai` async client (`stream_options.include_usage`), for `--duration-s`; requests in flight at the end
finish. Every stream is checked: no error, a chunk carrying a finish reason, then the usage chunk, and no
more text deltas than its `completion_tokens` (a delta holds one token or more). Reported: requests,
failed and truncated streams, TTFT (request sent -> first text delta) and TPOT ((last - first delta) /
(completion tokens - 1)) at p50/p99, output tokens/s, and the job's tokens trained during the run.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from coserve.bench.run_metrics import percentile_ms

KEY = "sk-load-tenant-0123456789"
ADMIN_KEY = "sk-load-admin-0123456789"  # reads /metrics (the per-engine counts)
MODEL_DIR = Path(".coserve/models/tiny-llama")
WORDS = "the a river stone quiet bright garden number story window morning light city paper".split()


@dataclass
class StreamResult:
    """One streamed request: its latencies and whether it ended properly."""

    ok: bool
    truncated: bool = False
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0


@dataclass
class LoadStats:
    """Every finished request of the run."""

    results: list[StreamResult] = field(default_factory=list)


def _prompt(rng: random.Random) -> list[dict[str, str]]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 48)))
    return [{"role": "user", "content": f"Tell me about {words}."}]


async def one_stream(client: openai.AsyncOpenAI, model: str, rng: random.Random) -> StreamResult:
    """Send one streamed chat completion and check that the stream is complete."""
    sent = time.monotonic()
    times: list[float] = []
    finish, usage = None, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=_prompt(rng), max_tokens=rng.randint(16, 64), temperature=0.8,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    times.append(time.monotonic())
                if choice.finish_reason is not None:
                    finish = choice.finish_reason
    except (openai.APIError, httpx.HTTPError) as exc:  # a failed request or a broken stream
        return StreamResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
    # Complete: a finish reason, then the usage chunk, and no more text deltas than tokens (a delta holds
    # one token or more: the detokenizer holds back partial characters).
    if finish is None or usage is None or not times or len(times) > usage.completion_tokens:
        return StreamResult(ok=False, truncated=True, tokens=len(times))
    tokens = usage.completion_tokens
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
    return StreamResult(ok=True, ttft_s=times[0] - sent, tpot_s=tpot, tokens=tokens)


async def client_loop(client: openai.AsyncOpenAI, model: str, seed: int, stop_at: float,
                      stats: LoadStats) -> None:
    """Requests one after another until `stop_at` (the request in flight then finishes)."""
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        stats.results.append(await one_stream(client, model, rng))


def ensure_model(model: Path) -> None:
    """The tiny model `make run` serves (created if missing)."""
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "coserve.cli", "model", "create-tiny", str(model), "--arch",
                        "llama", "--preset", "tiny"], check=True)


def start_server(root: Path, model: Path, port: int, ray: bool,
                 tenants_file: dict[str, object] | None = None, engines: int | None = None,
                 flags: list[str] | None = None) -> subprocess.Popen:
    """`coserve serve` in its own process group; returns once /health answers. `tenants_file` is the
    tenants file's content (default: the one tenant `load`, key `KEY`); `flags` more `serve` flags."""
    tenants = root / "tenants.yaml"
    tenants.write_text(json.dumps(tenants_file or {"tenants": {"load": {"api_keys": [KEY]}},
                                                   "admin_api_keys": [ADMIN_KEY]}))
    cmd = [sys.executable, "-m", "coserve.cli", "serve", "--model", str(model), "--tenants", str(tenants),
           "--data-dir", str(root / "data"), "--port", str(port), *([] if ray else ["--local"]),
           *([] if engines is None else ["--engines", str(engines)]), *(flags or [])]
    log = open(root / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited: {(root / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError("server did not answer /health in 180 s")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (Ray's too), then wait."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def start_job(client: openai.OpenAI, model: str, epochs: int) -> str:
    """Upload a 200-example chat dataset and start a fine-tuning job on it; returns the job id. With 50
    epochs it trains well past the end of a run."""
    lines = [{"messages": [{"role": "user", "content": f"Count to {i}, slowly."},
                           {"role": "assistant", "content": " ".join(str(k) for k in range(1, i % 60 + 2))}]}
             for i in range(200)]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    file = client.files.create(file=("load.jsonl", io.BytesIO(data)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model=model, training_file=file.id, suffix="load",
                                         hyperparameters={"n_epochs": epochs, "batch_size": 4})
    return job.id


def _percentiles_ms(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile_ms(values, 50), "p99": percentile_ms(values, 99)}


def report(stats: LoadStats, wall_s: float, job: object, trained_before: int) -> dict[str, object]:
    """The run's numbers (what `--json` writes)."""
    ok = [r for r in stats.results if r.ok]
    return {
        "requests": len(stats.results), "failed": sum(1 for r in stats.results if r.error is not None),
        "truncated": sum(1 for r in stats.results if r.truncated),
        "errors": sorted({r.error for r in stats.results if r.error})[:5],
        "ttft_ms": _percentiles_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _percentiles_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "output_tokens_per_s": sum(r.tokens for r in ok) / wall_s, "wall_s": wall_s,
        "finetune": {"status": job.status, "trained_tokens_during_run": (job.trained_tokens or 0) - trained_before},
    }


async def drive(url: str, model: str, clients: int, duration_s: float) -> tuple[LoadStats, float]:
    """`clients` concurrent client loops for `duration_s`; returns the stats and the wall time."""
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120,
                                http_client=openai.DefaultAsyncHttpxClient(
                                    limits=httpx.Limits(max_connections=clients + 8)))
    stats = LoadStats()
    start = time.monotonic()
    async with client:
        await asyncio.gather(*(client_loop(client, model, seed, start + duration_s, stats)
                               for seed in range(clients)))
    return stats, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--ray", action="store_true", help="serve on Ray (default: --local)")
    parser.add_argument("--engines", type=int, default=None, help="engine actors (with --ray; default: 1 on the CPU)")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.engines is not None and not args.ray:
        parser.error("--engines needs --ray (one engine actor per GPU or core runs on Ray)")
    ensure_model(MODEL_DIR)
    model = MODEL_DIR.resolve().name
    with tempfile.TemporaryDirectory(prefix="coserve-load-") as tmp:
        server = start_server(Path(tmp), MODEL_DIR, args.port, args.ray, engines=args.engines)
        try:
            url = f"http://127.0.0.1:{args.port}/v1"
            sync = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
            job_id = start_job(sync, model, epochs=50)
            time.sleep(3.0)  # let the job start training before the clients come
            trained_before = sync.fine_tuning.jobs.retrieve(job_id).trained_tokens or 0
            stats, wall = asyncio.run(drive(url, model, args.clients, args.duration_s))
            job = sync.fine_tuning.jobs.retrieve(job_id)
            result = {**run_header(args), **report(stats, wall, job, trained_before),
                      "per_engine": per_engine(f"http://127.0.0.1:{args.port}")}
            if job.status not in ("succeeded", "failed", "cancelled"):
                sync.fine_tuning.jobs.cancel(job_id)
        finally:
            stop_server(server)
    emit(result, args.json)


def per_engine(base_url: str) -> dict[str, dict[str, float]]:
    """Completion and fine-tuning tokens and iterations by engine, from the server's /metrics (over the
    whole server's life: the run and the job's first seconds)."""
    import re

    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).text
    found: dict[str, dict[str, float]] = {}
    for _name, labels, value in re.findall(r"^(coserve_tokens_total|coserve_engine_iterations_total)\{(.*)\} (\S+)$",
                                          text, re.M):
        engine = re.search(r'engine="([^"]+)"', labels)
        kind = re.search(r'kind="([^"]+)"', labels)
        if engine is None or (kind is not None and kind.group(1) == "prompt"):
            continue
        key = "iterations" if kind is None else f"{kind.group(1)}_tokens"
        row = found.setdefault(engine.group(1), {})
        row[key] = row.get(key, 0.0) + float(value)
    return found


def run_header(args: argparse.Namespace) -> dict[str, object]:
    """What a result says about its run: mode, clients, duration, machine and date."""
    return {"mode": "ray" if args.ray else "local", "engines": args.engines or 1, "clients": args.clients,
            "duration_s": args.duration_s,
            "machine": f"{platform.machine()} x{os.cpu_count()}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def emit(result: dict[str, object], path: Path | None) -> None:
    """Print the result, and write it to `path` when given."""
    print(json.dumps(result, indent=2))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
