"""Test helpers: `coserve serve --local`'s app (uvicorn in a thread) with the tenants a test needs, the
server as a user starts it (a subprocess), and polling a fine-tuning job through the official client."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types.fine_tuning import FineTuningJob

from coserve.server.assembly import build_local_app
from coserve.server.options import ServeOptions
from uvicorn_thread import serve_in_thread

TERMINAL = ("succeeded", "failed", "cancelled")
# A server subprocess's environment: one OpenMP thread (the tiny models gain nothing from a second).
SERVE_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# Every tenants file written here has this admin key: /metrics needs one.
ADMIN_KEY = "sk-test-admin-0123456789"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


def scrape(url: str) -> str:
    """`GET {url}/metrics` as an admin (tenant labels included)."""
    response = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS, timeout=30)
    response.raise_for_status()
    return response.text


def local_app(model: Path, root: Path, tenants: dict[str, Any], **options: Any) -> tuple[Any, ServeOptions]:
    """The app and its options: tenants file and data dir under `root`, float32, small batch limits
    (8 sequences, 256 tokens) and a 128 MiB KV cache (the tiny model's blocks are small; the suite's process
    holds many servers' in turn) unless `options` say otherwise."""
    path = root / "tenants.yaml"
    path.write_text(json.dumps({"tenants": tenants, "admin_api_keys": [ADMIN_KEY]}))
    settings = {"dtype": "float32", "max_num_seqs": 8, "max_batch_tokens": 256, "kv_cache_memory_gb": 0.125,
                **options}
    opts = ServeOptions(model=str(model), tenants=str(path), data_dir=str(root / "data"), local=True, **settings)
    opts.validate()
    return build_local_app(opts), opts


@dataclass(frozen=True)
class LocalServer:
    """A running `local_server`: its base URL (`http://127.0.0.1:PORT`) and the base model's id."""

    url: str
    base: str

    def client(self, key: str) -> openai.OpenAI:
        """The official client as tenant `key`; no retries, so an error surfaces at once."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)


@contextmanager
def local_server(model: Path, root: Path, tenants: dict[str, Any], **options: Any) -> Iterator[LocalServer]:
    """Serve `local_app(...)` until the block ends."""
    app, opts = local_app(model, root, tenants, **options)
    with serve_in_thread(app) as url:
        yield LocalServer(url, opts.base_model_id)


def poll_job(oa: openai.OpenAI, job_id: str, done: Callable[[FineTuningJob], bool] = lambda j: j.status in TERMINAL,
             timeout: float = 60.0, interval: float = 0.05) -> FineTuningJob:
    """Retrieve the job until `done(job)` (default: a final status); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    job = oa.fine_tuning.jobs.retrieve(job_id)
    while not done(job):
        assert time.monotonic() < deadline, f"job {job_id} did not get there in {timeout} s: {job.status}"
        time.sleep(interval)
        job = oa.fine_tuning.jobs.retrieve(job_id)
    return job


def upload_jsonl(oa: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    """Upload `lines` as a fine-tuning JSONL file; returns its id."""
    data = "\n".join(json.dumps(line) for line in lines).encode()
    return oa.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune").id


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command(model: Path, tenants: Path, data_dir: Path, port: int) -> list[str]:
    """The `coserve serve --local` command line (float32; run it with `SERVE_ENV`)."""
    return [sys.executable, "-m", "coserve.cli", "serve", "--local", "--model", str(model), "--tenants",
            str(tenants), "--data-dir", str(data_dir), "--port", str(port), "--dtype", "float32"]


@contextmanager
def serve_subprocess(model: Path, tenants: Path, data_dir: Path, key: str,
                     flags: Sequence[str] = ()) -> Iterator[tuple[subprocess.Popen, openai.OpenAI]]:
    """`coserve serve --local` (plus `flags`) in a subprocess; yields it and a client (API key `key`) once
    it answers. On exit a server still running gets SIGINT (Ctrl-C: a clean stop), and is killed after 30 s."""
    port = free_port()
    log = data_dir.parent / f"server-{port}.log"
    cmd = [*serve_command(model, tenants, data_dir, port), *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=SERVE_ENV)
    try:
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)
        deadline = time.monotonic() + 90
        while True:
            try:
                oa.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.2)
        yield proc, oa
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def one_tenant_subprocess(model: Path, root: Path, tenant: str, key: str,
                          flags: Sequence[str] = ()) -> Iterator[tuple[openai.OpenAI, str]]:
    """`serve_subprocess` for one tenant with API key `key` (its tenants file and data dir under `root`);
    yields the tenant's client and the base model's id."""
    tenants = root / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {tenant: {"api_keys": [key]}}}))
    with serve_subprocess(model, tenants, root / "data", key, flags) as (_, oa):
        yield oa, oa.models.list().data[0].id
