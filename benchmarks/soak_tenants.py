"""Soak of the tenant boundary (issue 45): an attacker tenant runs every case of the issue in a loop while a
victim tenant chats, fine-tunes and trains through Tinker, on one real server.

    .venv/bin/python benchmarks/soak_tenants.py [--model DIR] [--ray] [--duration-s 180] [--warmup-s 10]
                                                [--quiet-s 30] [--chat-pause-s 1] [--serve-flag=--FLAG=V]
                                                [--server-log FILE] [--json OUT]

Starts `coserve serve --enable-python-graders` (`--local` unless `--ray`; the tiny model unless `--model`)
with two tenants. The victim (benchmarks/_soak_victim.py) chats with two clients (one streamed, one not;
with the base model and, once it has one, its fine-tuned model), runs fine-tuning jobs one after another
and trains through the official `tinker` SDK (forward_backward + optim_step + sample). It runs alone for
`--warmup-s` (not counted) and `--quiet-s`, then the attacker (benchmarks/_soak_attacker.py, its requests from
coserve/bench/tenant_attacks.py) runs beside it for `--duration-s`: python grader escapes, token ids past
the vocabulary, a zstd bomb, CSR shapes of 2^40 and 2^20 x 2^20, poisoned uploads and a DPO job on a
poisoned file, big powers, a grader of thousands of graders, ROUGE-L on huge texts, 8 idle Tinker runs
against 4 adapter slots, saves past its storage quota, names ending in a newline, session and telemetry
floods.

Reported: the victim's errors (target 0), its chat TTFT and latency p50/p99 quiet and under attack, its
jobs and Tinker rounds; each attack's answers (`<status> <verdict>`: each must be a refusal or contained,
never a 5xx); /health polled every 0.2 s (target: slowest < 1 s); the server's RSS (its processes summed)
quiet and at its peak; the date, the command and the machine's load average. Exit status 1 when the
victim saw an error, an attack was neither refused nor contained, or /health failed or took 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from _soak_attacker import Attacker
from _soak_victim import Victim, summarize
from coserve.bench.grader_escapes import EscapeTarget
from coserve.model.config import ModelConfig
from coserve.model.memory import adapter_bytes
from load import ADMIN_KEY, MODEL_DIR, emit, ensure_model, start_server, stop_server
from server_watch import ServerWatch

ATTACKER, ATTACKER_TINKER = "sk-soak-attacker-0123456789", "tml-soak-attacker-0123456789"
VICTIM, VICTIM_TINKER = "sk-soak-victim-0123456789", "tml-soak-victim-0123456789"
HEALTH_BOUND_MS = 1000


def tenants(quota: int) -> dict[str, Any]:
    """The attacker: room for its 9 runs and a job (10 at once), and storage for two saves and a bit."""
    return {"tenants": {"attacker": {"api_keys": [ATTACKER, ATTACKER_TINKER],
                                     "limits": {"max_concurrent_jobs": 10, "max_stored_bytes": quota}},
                        "victim": {"api_keys": [VICTIM, VICTIM_TINKER]}},
            "admin_api_keys": [ADMIN_KEY]}


def storage_quota(model: Path) -> int:
    """Two and a half of the attacker's rank-4 saves (float32), plus 64 kB for its DPO file."""
    return int(2.5 * adapter_bytes(ModelConfig.from_pretrained(model), 4, 4)) + 64_000


def escape_target(root: Path, server_pid: int, port: int) -> EscapeTarget:
    data = root / "data"
    uploads = [str(p) for p in (data / "files").rglob("*") if p.is_file()][:1]
    return EscapeTarget(server_pid=server_pid, port=port, tenants_file=str(root / "tenants.yaml"),
                        data_dir=str(data), store=str(data / "metadata.sqlite3"),
                        secrets=(str(root / "tenants.yaml"), str(data), str(data / "metadata.sqlite3"), *uploads,
                                 str(Path(__file__).resolve().parents[1])))


def tokens_by_tenant(url: str) -> dict[str, dict[str, float]]:
    """Prompt, completion and fine-tuning tokens by tenant so far, from the server's /metrics."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60).text
    found: dict[str, dict[str, float]] = {}
    for labels, value in re.findall(r"^coserve_tokens_total\{(.*)\} (\S+)$", text, re.M):
        kind, tenant = re.search(r'kind="([^"]+)"', labels), re.search(r'tenant="([^"]+)"', labels)
        if kind is not None and tenant is not None:
            row = found.setdefault(tenant.group(1), {})
            row[kind.group(1)] = row.get(kind.group(1), 0.0) + float(value)
    return found


def token_rates(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                seconds: float) -> dict[str, dict[str, float]]:
    """Tokens per second by tenant and kind between two `tokens_by_tenant`."""
    return {tenant: {kind: round((n - before.get(tenant, {}).get(kind, 0.0)) / seconds, 2) for kind, n in kinds.items()}
            for tenant, kinds in after.items()}


def passed(result: dict[str, Any]) -> bool:
    return (result["victim"]["errors"] == 0 and not result["attacks"]["not_refused_or_contained"]
            and result["health"]["failures"] == 0 and result["health"]["slowest_ms"] < HEALTH_BOUND_MS)


def soak(args: argparse.Namespace, root: Path, model: str, vocab: int, quota: int) -> dict[str, Any]:
    """Start the server, run the quiet phase and the attack; the numbers."""
    server = start_server(root, args.model, args.port, args.ray, tenants_file=tenants(quota),
                          flags=["--enable-python-graders", *args.serve_flag])
    url = f"http://127.0.0.1:{args.port}"
    watch = ServerWatch(server.pid, url)
    try:
        victim = Victim(f"{url}/v1", model, VICTIM, VICTIM_TINKER, args.chat_pause_s)
        victim.start()
        time.sleep(args.warmup_s)
        watch.mark()
        victim.record.quiet_at, at_quiet = time.monotonic(), tokens_by_tenant(url)
        time.sleep(args.quiet_s)
        quiet_peak, quiet_rss = watch.peak_since_mark(), watch.mark()
        victim.record.attack_at = time.monotonic()
        at_attack = tokens_by_tenant(url)
        attacker = Attacker(url, model, vocab, (ATTACKER, ATTACKER_TINKER), escape_target(root, server.pid, args.port),
                            (ATTACKER, ATTACKER_TINKER, VICTIM, VICTIM_TINKER, ADMIN_KEY), victim.file_id, quota,
                            root / "data")
        attacker.start()
        time.sleep(args.duration_s)
        attacker.stop()
        victim.stop()
        at_end, attack_s = tokens_by_tenant(url), time.monotonic() - victim.record.attack_at
        slow = sorted(watch.slow_polls(), key=lambda poll: -poll[1])[:10]
        health = {**watch.health(), "slowest_polls": [
            {"ms": round(seconds * 1000), "phase": victim.record.phase(start),
             "attacker_in_flight": attacker.in_flight(start, start + seconds)} for start, seconds in slow]}
        return {"victim": summarize(victim.record), "attacks": attacker.summary(), "health": health,
                "tokens_per_s": {"quiet": token_rates(at_quiet, at_attack, args.quiet_s),
                                 "attack": token_rates(at_attack, at_end, attack_s)},
                "server_rss_mb": {"quiet_peak": quiet_peak, "at_attack_start": quiet_rss,
                                  "peak_under_attack": watch.peak_since_mark()},
                "attacker_storage_quota_bytes": quota}
    finally:
        watch.stop()
        stop_server(server)
        if args.server_log is not None:
            shutil.copyfile(root / "server.log", args.server_log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="model folder (default: the tiny model)")
    parser.add_argument("--ray", action="store_true", help="serve on Ray (default: --local)")
    parser.add_argument("--duration-s", type=float, default=180.0, help="the attack's length")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="the victim alone, not counted")
    parser.add_argument("--quiet-s", type=float, default=30.0, help="then the victim alone, for its quiet figures")
    parser.add_argument("--chat-pause-s", type=float, default=1.0, help="each victim chat client's pause between "
                        "requests (back to back, two clients leave fine-tuning only its minimum share)")
    parser.add_argument("--port", type=int, default=8131)
    parser.add_argument("--server-log", type=Path, default=None, help="keep the server's log here")
    parser.add_argument("--serve-flag", action="append", default=[], help="a flag for coserve serve, repeated "
                        "(--serve-flag=--tpot-slo-ms=500)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.model == MODEL_DIR:
        ensure_model(MODEL_DIR)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    header = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "mode": "ray" if args.ray else "local",
              "model": args.model.resolve().name, "duration_s": args.duration_s, "quiet_s": args.quiet_s,
              "warmup_s": args.warmup_s, "chat_pause_s": args.chat_pause_s,
              "machine": f"{platform.machine()} x{os.cpu_count()}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory(prefix="coserve-soak-tenants-") as tmp:
        result = soak(args, Path(tmp), header["model"], vocab, storage_quota(args.model))
    result = {**header, "load_average_after": [round(x, 2) for x in os.getloadavg()], "passed": False, **result}
    result["passed"] = passed(result)
    emit(result, args.json)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
