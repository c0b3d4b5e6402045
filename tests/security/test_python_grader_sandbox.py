"""A hostile tenant's python graders against the real server (`coserve serve --local --enable-python-graders`
in a subprocess, as root here and in CI), through the official `openai` client's
`client.fine_tuning.alpha.graders.run`: every escape of issue 45 fails, and the victim tenant's chat and
graders, and `/health`, are served throughout.

Each attacking grader returns 1.0 when its escape worked and 0.0 when it failed, so a sandbox that let it
through fails the test (and a grader that broke for another reason shows as a runtime error, which the
tests also refuse). The escapes' sources are `coserve/bench/grader_escapes.py`'s, which the soak
(benchmarks/soak_tenants.py) runs in a loop."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coserve.bench.grader_escapes import (
    NETWORK,
    NO_AUDIT_HOOK,
    READ_SECRETS,
    SIGNAL_SERVER,
    WRITE_STORE,
    alive,
    setsid_grandchild,
)
from local_server import ADMIN_KEY, serve_subprocess, upload_jsonl
from sandbox_support import require_sandbox

require_sandbox()

ATTACKER, VICTIM = "sk-attacker-0123456789", "sk-victim-0123456789"


@dataclass(frozen=True)
class Server:
    url: str
    pid: int
    port: int
    root: Path
    model: str

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("sandbox")
    tenants = root / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"attacker": {"api_keys": [ATTACKER]},
                                               "victim": {"api_keys": [VICTIM]}},
                                   "admin_api_keys": [ADMIN_KEY]}))
    with serve_subprocess(llama_dir, tenants, root / "data", VICTIM, ["--enable-python-graders"]) as (proc, oa):
        url = str(oa.base_url).rstrip("/").removesuffix("/v1")
        row = {"messages": [{"role": "user", "content": "victim-secret-42"}, {"role": "assistant", "content": "ok"}]}
        assert upload_jsonl(oa, [row] * 10)
        yield Server(url, proc.pid, int(url.rsplit(":", 1)[1]), root, oa.models.list().data[0].id)


def attack(server: Server, source: str, item: dict[str, Any] | None = None) -> Any:
    """Grade with the attacker's `source` (its function `grade`); the answer, checked to have run cleanly."""
    result = server.client(ATTACKER).fine_tuning.alpha.graders.run(
        grader={"type": "python", "name": "attack", "source": source}, model_sample="x",  # type: ignore[arg-type]
        item=item or {})
    errors = result.metadata.errors
    assert not errors.python_grader_server_error, errors
    assert not errors.python_grader_runtime_error, errors.python_grader_runtime_error_details
    return result


def assert_victim_served(server: Server) -> None:
    """/health within 1 s and the victim's chat and python grader complete."""
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert time.monotonic() - start < 1.0
    victim = server.client(VICTIM)
    reply = victim.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    graded = victim.fine_tuning.alpha.graders.run(
        grader={"type": "python", "name": "ok", "source": "def grade(s, i):\n    return 1.0\n"},  # type: ignore[arg-type]
        model_sample="x")
    assert graded.reward == 1.0


def secrets(server: Server) -> dict[str, Path]:
    data = server.root / "data"
    uploads = [p for p in (data / "files").rglob("*") if p.is_file()]
    paths = {"tenants file": server.root / "tenants.yaml", "data dir": data, "store": data / "metadata.sqlite3",
             "upload": uploads[0], "repository": Path(__file__).resolve().parents[2]}
    for what, path in paths.items():
        assert path.exists(), f"the test's {what} {path} is missing"
    return paths


def test_the_tenants_file_data_dir_store_and_uploads_are_not_there(server: Server) -> None:
    paths = [str(p) for p in secrets(server).values()]
    assert attack(server, READ_SECRETS, {"paths": paths}).reward == 0.0
    reader = f"def grade(s, i):\n    return open({paths[0]!r}).read()\n"
    leak = server.client(ATTACKER).fine_tuning.alpha.graders.run(
        grader={"type": "python", "name": "leak", "source": reader}, model_sample="x")  # type: ignore[arg-type]
    details = leak.metadata.errors.python_grader_runtime_error_details or ""
    assert "FileNotFoundError" in details and VICTIM not in details and ADMIN_KEY not in details


def test_the_store_cannot_be_written(server: Server) -> None:
    store = str(secrets(server)["store"])
    before = server.client(VICTIM).files.list().data
    assert attack(server, WRITE_STORE, {"store": store}).reward == 0.0
    assert [f.id for f in server.client(VICTIM).files.list().data] == [f.id for f in before] != []
    assert server.client(ATTACKER).files.list().data == []


def test_signals_to_the_server_do_not_reach_it(server: Server) -> None:
    assert attack(server, SIGNAL_SERVER, {"server": server.pid}).reward == 0.0
    assert_victim_served(server)


def test_no_audit_hook_to_disable_and_subprocess_and_ctypes_stay_inside(server: Server) -> None:
    paths = secrets(server)
    result = attack(server, NO_AUDIT_HOOK, {"tenants": str(paths["tenants file"]), "server": server.pid})
    assert result.reward == 0.0
    assert_victim_served(server)


def test_no_network_not_even_the_servers_port(server: Server) -> None:
    assert attack(server, NETWORK, {"port": server.port, "server": server.pid}).reward == 0.0


def test_a_setsid_grandchild_dies_with_the_grader(server: Server) -> None:
    token = "271.828"
    assert attack(server, setsid_grandchild(token, "pass")).reward == 0.0  # 0.5: the grandchild never ran
    time.sleep(0.2)
    assert alive(token) == []


@pytest.mark.slow
def test_a_grader_killed_at_its_wall_clock_limit_leaves_nothing_behind(server: Server) -> None:
    token = "314.159"
    result = server.client(ATTACKER).fine_tuning.alpha.graders.run(
        grader={"type": "python", "name": "stay", "source": setsid_grandchild(token, "time.sleep(600)")},  # type: ignore[arg-type]
        model_sample="x")
    assert result.metadata.errors.python_grader_server_error_type == "timeout"
    time.sleep(0.2)
    assert alive(token) == []


def test_a_tenant_flooding_python_graders_leaves_the_victim_its_slot(server: Server) -> None:
    slow = {"type": "python", "name": "slow",
            "source": "import time\ndef grade(s, i):\n    time.sleep(2)\n    return 1.0\n"}
    attacker = server.client(ATTACKER)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        flood = [pool.submit(attacker.fine_tuning.alpha.graders.run, grader=slow, model_sample="x")  # type: ignore[arg-type]
                 for _ in range(6)]
        time.sleep(0.5)  # the attacker holds its slot and queues the rest
        start = time.monotonic()
        assert_victim_served(server)
        assert time.monotonic() - start < 5.0  # FIFO over two global slots: behind 6 x 2 s, or a 429
        outcomes = []
        for future in flood:
            try:
                outcomes.append(future.result(timeout=60).reward)
            except openai.RateLimitError:
                outcomes.append("429")
    assert outcomes.count(1.0) >= 3, outcomes  # one slot at a time for the attacker, in its own line
