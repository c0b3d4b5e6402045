"""Hostile inputs against the real server as `make run` starts it (`coserve serve --local`, SmolLM2, the
Makefile's environment: llguidance 1.7 as vLLM pins it), one process we can watch: every size a client
controls pushed past its limit (coserve/bench/hostile.py). Each request gets a 4xx naming its param,
or a bounded 200; the server's resident memory stays within `RSS_BOUND_MB` of its warm baseline; and
/health answers throughout."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from coserve.bench.hostile import Attack, Outcome, grammar_attacks, sampling_attacks
from local_server import serve_subprocess

pytestmark = pytest.mark.real_model
KEY = "sk-hostile-0123456789"
RSS_BOUND_MB = 500  # over the warm server (~1.6 GB on SmolLM2); one unbounded schema took 8+ GB


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class HealthWatch:
    """Polls /health every 100 ms in a thread; counts the answers that were not a 200 in 10 s."""

    def __init__(self, url: str) -> None:
        self._url, self._stop = url, threading.Event()
        self.polls, self.failures = 0, []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.wait(0.1):
                self.polls += 1
                try:
                    status = http.get(f"{self._url}/health").status_code
                except httpx.HTTPError as error:
                    status = type(error).__name__
                if status != 200:
                    self.failures.append(status)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int]]:
    root = tmp_path_factory.mktemp("hostile")
    tenants = root / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"mallory": {"api_keys": [KEY]}}}))
    with serve_subprocess(smollm2_dir, tenants, root / "data", KEY) as (proc, oa):
        base = oa.models.list().data[0].id
        yield str(oa.base_url).removesuffix("/v1/"), base, proc.pid


def _send(http: httpx.Client, model: str, name: str, attack: Attack) -> str | None:
    """None when the answer is what `attack` must get; else what went wrong."""
    response = http.post("/v1/chat/completions", content=attack.text(model),
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    if attack.outcome is Outcome.SERVED:
        return None if response.status_code == 200 else f"{name}: {response.status_code} {response.text[:300]}"
    if not 400 <= response.status_code < 500:
        return f"{name}: {response.status_code} {response.text[:300]}"
    param = response.json()["error"].get("param") or ""
    if attack.param is not None and not param.startswith(attack.param):
        return f"{name}: param {param!r}, wanted {attack.param!r} ({response.json()['error']['message']})"
    return None


def test_every_hostile_request_is_refused_or_bounded_and_the_server_stays_small(server: tuple[str, str, int],
                                                                                smollm2_dir: Path) -> None:
    url, model, pid = server
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    attacks = {**grammar_attacks(), **sampling_attacks(vocab)}
    with httpx.Client(base_url=url, timeout=120) as http:
        warm = [a for a in attacks.values() if a.outcome is Outcome.SERVED]
        assert [_send(http, model, "warm-up", a) for a in warm] == [None] * len(warm)
        baseline_mb = _status_kb(pid, "VmRSS") / 1024
        health = HealthWatch(url)
        try:
            wrong = [_send(http, model, name, attack) for name, attack in attacks.items()]
            with ThreadPoolExecutor(8) as pool:  # and all at once
                wrong += list(pool.map(lambda item: _send(http, model, *item), attacks.items()))
            time.sleep(0.5)
        finally:
            health.stop()
    peak_mb = _status_kb(pid, "VmHWM") / 1024
    assert [w for w in wrong if w] == []
    assert health.failures == [] and health.polls > 10
    assert peak_mb - baseline_mb < RSS_BOUND_MB, (baseline_mb, peak_mb)
