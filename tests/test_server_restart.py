"""Durability: `coserve serve` killed (SIGKILL) in the middle of a fine-tuning job, then started again on the
same data dir: the upload, the job and its checkpoints are still there, the job resumes from its last
checkpoint (not from scratch) and succeeds, and its fine-tuned model answers."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from local_server import poll_job

KEY = "sk-restart-tenant-0123"
# Long enough answers that an epoch takes seconds on the tiny model: the kill lands between two epochs.
LINES = [{"messages": [{"role": "user", "content": f"List the numbers from {i} on."},
                       {"role": "assistant", "content": " ".join(str(i + k) for k in range(40))}]}
         for i in range(60)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(model: Path, tenants: Path, data_dir: Path) -> Iterator[tuple[subprocess.Popen, openai.OpenAI]]:
    """`coserve serve --local` in a subprocess; yields it and a client once it answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "coserve.cli", "serve", "--local", "--model", str(model), "--tenants",
           str(tenants), "--data-dir", str(data_dir), "--port", str(port), "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=30)
        deadline = time.monotonic() + 90
        while True:
            try:
                oa.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        yield proc, oa
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.timeout(300)
def test_a_killed_server_resumes_the_job_from_its_checkpoint(llama_dir: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": [KEY]}}}))
    data = "\n".join(json.dumps(line) for line in LINES).encode()
    with running_server(llama_dir, tenants, tmp_path / "data") as (proc, oa):
        file_id = oa.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune").id
        job = oa.fine_tuning.jobs.create(model=llama_dir.name, training_file=file_id, suffix="kill", seed=1,
                                         hyperparameters={"n_epochs": 3, "batch_size": 10})
        # After the first epoch's checkpoint, while the second epoch trains: kill, no clean shutdown.
        poll_job(oa, job.id, lambda j: bool(oa.fine_tuning.jobs.checkpoints.list(j.id).data), timeout=120)
        assert oa.fine_tuning.jobs.retrieve(job.id).status == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with running_server(llama_dir, tenants, tmp_path / "data") as (_, oa):
        assert oa.files.content(file_id).read() == data
        job = poll_job(oa, job.id, timeout=120)
        assert job.status == "succeeded", job.error
        messages = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data]
        assert "Resumed from the last checkpoint" in messages
        steps = [c.step_number for c in oa.fine_tuning.jobs.checkpoints.list(job.id).data]
        assert steps == sorted(set(steps), reverse=True) and steps[0] == 18  # 60 / 10 x 3 epochs, no repeats
        reply = oa.chat.completions.create(model=job.fine_tuned_model, max_tokens=4,
                                           messages=[{"role": "user", "content": "List the numbers from 3 on."}])
        assert reply.choices[0].message.content is not None
