"""Durability: `coserve serve` killed (SIGKILL) in the middle of a fine-tuning job, then started again on the
same data dir: the upload, the job and its checkpoints are still there, the job resumes from its last
checkpoint (not from scratch) and succeeds, and its fine-tuned model answers."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import pytest
from local_server import poll_job, serve_subprocess

KEY = "sk-restart-tenant-0123"
# Long enough answers that an epoch takes seconds on the tiny model: the kill lands between two epochs.
LINES = [{"messages": [{"role": "user", "content": f"List the numbers from {i} on."},
                       {"role": "assistant", "content": " ".join(str(i + k) for k in range(40))}]}
         for i in range(60)]


@pytest.mark.timeout(300)
def test_a_killed_server_resumes_the_job_from_its_checkpoint(llama_dir: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": [KEY]}}}))
    data = "\n".join(json.dumps(line) for line in LINES).encode()
    with serve_subprocess(llama_dir, tenants, tmp_path / "data", KEY) as (proc, oa):
        file_id = oa.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune").id
        job = oa.fine_tuning.jobs.create(model=llama_dir.name, training_file=file_id, suffix="kill", seed=1,
                                         hyperparameters={"n_epochs": 3, "batch_size": 10})
        # After the first epoch's checkpoint, while the second epoch trains: kill, no clean shutdown.
        poll_job(oa, job.id, lambda j: bool(oa.fine_tuning.jobs.checkpoints.list(j.id).data), timeout=120)
        assert oa.fine_tuning.jobs.retrieve(job.id).status == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with serve_subprocess(llama_dir, tenants, tmp_path / "data", KEY) as (_, oa):
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
