"""Soak: heavy streaming load, a fine-tuning job, a light tenant and a stream of bad inputs, all at once.

    .venv/bin/python benchmarks/soak.py [--ray] [--clients 64] [--duration-s 60] [--model DIR] [--hostile]
                                        [--json OUT]

Starts `coserve serve` (`--local` unless `--ray`) with three tenants: `load` runs `--clients` streaming
clients back to back (benchmarks/load.py's clients, every stream checked for completeness) and a
fine-tuning job; `light` sends one short streamed request after another; `hostile` sends the bad inputs
of issue 16 round-robin (a body over the cap, a prompt far over the context, lax types, an empty body,
a body that is not JSON, a lone surrogate, `n` over the cap, a wrong key, an unknown model, a broken
upload), and with `--hostile` every size a client controls past its limit (issue 28: the schemas and
sampling parameters of coserve/bench/hostile.py; docs/limits.md). First the light tenant's TTFT is
measured on the quiet server, then under the soak.

Reported: 5xx answers and broken connections (target 0), the status codes each bad input got (each
must be a 4xx, or a 200 for the hostile requests that are served within bounds), lost jobs (the job
failed or vanished; target 0) and its trained tokens during the run, the heavy clients' numbers, the
light tenant's TTFT p50/p90 under soak over quiet (the fairness the virtual token counter promises: a
light tenant is not starved by a heavy one), the server's resident memory (its processes summed,
sampled every 0.5 s) quiet and at its peak, and /health polled every 0.2 s (failures, slowest answer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from coserve.bench.hostile import Outcome, grammar_attacks, sampling_attacks
from load import (
    KEY,
    MODEL_DIR,
    drive,
    emit,
    ensure_model,
    one_stream,
    report,
    run_header,
    start_job,
    start_server,
    stop_server,
)
from server_watch import ServerWatch

LIGHT_KEY, HOSTILE_KEY = "sk-soak-light-0123456789", "sk-soak-hostile-0123456789"
TENANTS = {"tenants": {"load": {"api_keys": [KEY]}, "light": {"api_keys": [LIGHT_KEY]},
                       "hostile": {"api_keys": [HOSTILE_KEY]}}}
JSON = {"Authorization": f"Bearer {HOSTILE_KEY}", "Content-Type": "application/json"}


def _chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


def hostile_inputs(model: str, vocab_size: int) -> dict[str, tuple[Callable[[httpx.AsyncClient], Any], str]]:
    """Name -> (a coroutine factory sending a size past its limit, the status class it must get: "4"
    or "2")."""
    attacks = {**grammar_attacks(), **sampling_attacks(vocab_size)}
    return {name: (lambda http, body=attack.text(model): http.post("/v1/chat/completions", content=body,
                                                                     headers=JSON),
                   "4" if attack.outcome is Outcome.REFUSED else "2")
            for name, attack in attacks.items()}


def bad_inputs(model: str) -> dict[str, Callable[[httpx.AsyncClient], Any]]:
    """Name -> a coroutine factory sending that bad input (each must be answered with a 4xx)."""
    chat = "/v1/chat/completions"

    def post(body: bytes | str, headers: dict[str, str] = JSON, path: str = chat) -> Callable[..., Any]:
        return lambda http: http.post(path, content=body, headers=headers)

    huge_prompt = json.dumps(_chat(model, messages=[{"role": "user", "content": "word " * 600_000}]))
    return {
        "body_over_cap": post(b'{"model": "' + b"x" * (9 << 20) + b'"}'),
        "prompt_over_context": post(huge_prompt),
        "stream_yes": post(json.dumps(_chat(model, stream="yes"))),
        "max_tokens_string": post(json.dumps(_chat(model, max_tokens="4"))),
        "max_tokens_bool": post(json.dumps(_chat(model, max_tokens=True))),
        "empty_body": post(b""),
        "not_json": post(b"{this is not json"),
        "json_list": post(b"[1, 2, 3]"),
        "lone_surrogate": post(f'{{"model": "{model}", "messages": [{{"role": "user", "content": "\\ud800"}}]}}'),
        "n_over_cap": post(json.dumps(_chat(model, n=128, max_tokens=2))),
        "wrong_key": post(json.dumps(_chat(model)), {**JSON, "Authorization": "Bearer sk-wrong"}),
        "unknown_model": post(json.dumps(_chat("no-such-model"))),
        "broken_upload": lambda http: http.post("/v1/files", headers={"Authorization": JSON["Authorization"]},
                                                data={"purpose": "fine-tune"},
                                                files={"file": ("x.jsonl", b"{not jsonl\n")}),
    }


async def hostile_loop(url: str, cases: dict[str, tuple[Callable[[httpx.AsyncClient], Any], str]],
                       stop_at: float, statuses: dict[str, Counter[str]]) -> None:
    """Send every bad input in turn until `stop_at`; record what each got."""
    async with httpx.AsyncClient(base_url=url.removesuffix("/v1"), timeout=120) as http:
        while time.monotonic() < stop_at:
            for name, (send, _) in cases.items():
                try:
                    status = str((await send(http)).status_code)
                except httpx.HTTPError as exc:
                    status = f"connection: {type(exc).__name__}"
                statuses.setdefault(name, Counter())[status] += 1
                await asyncio.sleep(0.05)


async def light_loop(url: str, model: str, stop_at: float, count: int | None = None) -> list[float]:
    """One short streamed request after another (until `stop_at`, or `count` of them); their TTFTs (s)."""
    client = openai.AsyncOpenAI(base_url=url, api_key=LIGHT_KEY, max_retries=0, timeout=120)
    rng, ttfts = random.Random(7), []
    async with client:
        while time.monotonic() < stop_at and (count is None or len(ttfts) < count):
            result = await one_stream(client, model, rng)
            if result.ttft_s is not None:
                ttfts.append(result.ttft_s)
            await asyncio.sleep(0.2)
    return ttfts


def _quantiles_ms(values: list[float]) -> dict[str, float | None]:
    if len(values) < 2:
        return {"p50": None, "p90": None, "n": len(values)}
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return {"p50": statistics.median(values) * 1000, "p90": cuts[8] * 1000, "n": len(values)}


async def soak(url: str, model: str, clients: int, duration_s: float,
               cases: dict[str, tuple[Callable[[httpx.AsyncClient], Any], str]]) -> dict[str, Any]:
    """The soak phase: heavy clients, the light tenant and the hostile one for `duration_s`."""
    statuses: dict[str, Counter[str]] = {}
    stop_at = time.monotonic() + duration_s
    (stats, wall), light, _ = await asyncio.gather(drive(url, model, clients, duration_s),
                                                   light_loop(url, model, stop_at),
                                                   hostile_loop(url, cases, stop_at, statuses))
    return {"stats": stats, "wall": wall, "light": light, "statuses": statuses}


def summarize(quiet: list[float], run: dict[str, Any], job: Any, trained_before: int,
              expected: dict[str, str]) -> dict[str, Any]:
    """The numbers `--json` writes (`expected`: each input's status class)."""
    statuses = {name: dict(counts) for name, counts in run["statuses"].items()}
    bad = {name: codes for name, codes in statuses.items()
           if any(not c.startswith(expected[name]) for c in codes)}
    quiet_q, soak_q = _quantiles_ms(quiet), _quantiles_ms(run["light"])
    heavy = report(run["stats"], run["wall"], job, trained_before)
    return {
        "server_errors_5xx_or_connection": sum(n for codes in statuses.values() for c, n in codes.items()
                                               if not c.startswith(("2", "4"))),
        "bad_inputs_not_4xx": bad, "bad_input_statuses": statuses,
        "lost_jobs": int(job.status in ("failed",)), "job_status": job.status,
        "light_ttft_quiet_ms": quiet_q, "light_ttft_soak_ms": soak_q,
        "light_ttft_ratio_p50": (soak_q["p50"] / quiet_q["p50"]) if quiet_q["p50"] and soak_q["p50"] else None,
        "heavy": heavy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--ray", action="store_true", help="serve on Ray (default: --local)")
    parser.add_argument("--engines", type=int, default=None, help="engines (with --ray)")
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="model folder (default: the tiny model)")
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--hostile", action="store_true",
                        help="also send every size a client controls past its limit (docs/limits.md)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.model == MODEL_DIR:
        ensure_model(MODEL_DIR)
    model = args.model.resolve().name
    cases = {name: (send, "4") for name, send in bad_inputs(model).items()}
    if args.hostile:
        vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
        cases |= hostile_inputs(model, vocab)
    with tempfile.TemporaryDirectory(prefix="coserve-soak-") as tmp:
        server = start_server(Path(tmp), args.model, args.port, args.ray, tenants_file=TENANTS, engines=args.engines)
        watch = ServerWatch(server.pid, f"http://127.0.0.1:{args.port}")
        try:
            url = f"http://127.0.0.1:{args.port}/v1"
            quiet = asyncio.run(light_loop(url, model, time.monotonic() + 60, count=12))
            sync = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
            job_id = start_job(sync, model, epochs=50)
            time.sleep(3.0)
            trained_before = sync.fine_tuning.jobs.retrieve(job_id).trained_tokens or 0
            quiet_rss = watch.mark()
            run = asyncio.run(soak(url, model, args.clients, args.duration_s, cases))
            job = sync.fine_tuning.jobs.retrieve(job_id)
            result = {**run_header(args), "model": model,
                      **summarize(quiet, run, job, trained_before, {n: c for n, (_, c) in cases.items()}),
                      "server_rss_mb": {"before_soak": quiet_rss, "peak_in_soak": watch.peak_since_mark()},
                      "health": watch.health()}
            if job.status not in ("succeeded", "failed", "cancelled"):
                sync.fine_tuning.jobs.cancel(job_id)
        finally:
            watch.stop()
            stop_server(server)
    emit(result, args.json)


if __name__ == "__main__":
    main()
