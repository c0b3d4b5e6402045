"""One server per data dir: a second `coserve serve --local` on a data dir that a running server holds exits
non-zero before it touches any job, with a message naming the dir and the holder, and the first keeps
serving (its running job gets no false "Resumed"); once the first is SIGKILLed, a new server starts on the
dir at once (the OS released the dead holder's lock) and resumes the job. `coserve serve` on Ray refuses a
held data dir before it starts Ray."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from coserve.actors.data_dir_lock import DataDirLock
from local_server import SERVE_ENV, TERMINAL, free_port, poll_job, serve_command, serve_subprocess

KEY = "sk-lock-tenant-0123"
LINES = [{"messages": [{"role": "user", "content": f"List the numbers from {i} on."},
                       {"role": "assistant", "content": " ".join(str(i + k) for k in range(40))}]}
         for i in range(60)]


@pytest.mark.timeout(300)
def test_a_second_server_on_a_held_data_dir_exits_and_the_first_keeps_serving(llama_dir: Path,
                                                                             tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": [KEY]}}}))
    data_dir = tmp_path / "data"
    body = "\n".join(json.dumps(line) for line in LINES).encode()
    with serve_subprocess(llama_dir, tenants, data_dir, KEY) as (first, oa):
        file_id = oa.files.create(file=("train.jsonl", io.BytesIO(body)), purpose="fine-tune").id
        job = oa.fine_tuning.jobs.create(model=llama_dir.name, training_file=file_id, seed=1,
                                         hyperparameters={"n_epochs": 20, "batch_size": 10})
        poll_job(oa, job.id, lambda j: j.status == "running", timeout=60)

        second = subprocess.run(serve_command(llama_dir, tenants, data_dir, free_port()), env=SERVE_ENV,
                                capture_output=True, text=True, timeout=90)
        assert second.returncode == 1, second.stderr[-2000:]
        assert f"data dir {data_dir.resolve()} is in use by another coserve server" in second.stderr
        assert f"pid {first.pid} on host" in second.stderr
        assert "Traceback" not in second.stderr and "serving" not in second.stdout

        # The first serves on: chat, and its job trains without a second scheduler resuming it.
        reply = oa.chat.completions.create(model=llama_dir.name, max_tokens=4,
                                           messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].message.content is not None
        job = oa.fine_tuning.jobs.retrieve(job.id)
        assert job.status == "running"
        messages = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=100)]
        assert not any("Resumed" in m for m in messages), messages
        poll_job(oa, job.id, lambda j: bool(oa.fine_tuning.jobs.checkpoints.list(j.id).data), timeout=120)
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The killed holder left its lock file but no lock: a new server starts and takes the job over.
    with serve_subprocess(llama_dir, tenants, data_dir, KEY) as (third, oa):
        assert json.loads((data_dir / ".lock").read_text())["pid"] == third.pid
        job = poll_job(oa, job.id, lambda j: j.status in TERMINAL or any(
            "Resumed" in e.message for e in oa.fine_tuning.jobs.list_events(j.id, limit=100)), timeout=60)
        assert job.status == "running"
        oa.fine_tuning.jobs.cancel(job.id)


@pytest.mark.timeout(120)
def test_coserve_serve_on_ray_refuses_a_held_data_dir_before_starting_ray(llama_dir: Path,
                                                                         tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": [KEY]}}}))
    with DataDirLock.acquire(tmp_path / "data"):  # another server (here: this process) holds the dir
        cmd = [arg for arg in serve_command(llama_dir, tenants, tmp_path / "data", free_port()) if arg != "--local"]
        second = subprocess.run(cmd, env=SERVE_ENV, capture_output=True, text=True, timeout=90)
    assert second.returncode == 1, second.stderr[-2000:]
    assert f"data dir {(tmp_path / 'data').resolve()} is in use by another coserve server" in second.stderr
    assert f"pid {os.getpid()} on host" in second.stderr
    assert "Traceback" not in second.stderr and "Ray" not in second.stdout + second.stderr
