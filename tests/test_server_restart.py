"""Durability: `coserve serve` killed (SIGKILL) in the middle of a fine-tuning job, then started again on the
same data dir: the upload, the job and its checkpoints are still there, the job resumes from its last
checkpoint (not from scratch) and succeeds, its history continues (trained_tokens never goes back and ends
at the uninterrupted total; each step's metrics event is stored once), and its fine-tuned model answers."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import openai
import pytest
from openai.types.fine_tuning import FineTuningJob
from transformers import AutoTokenizer

from coserve.model.config import ModelConfig
from local_server import TERMINAL, poll_job, serve_subprocess
from trainer_data import prepare_dataset

KEY = "sk-restart-tenant-0123"
# Long enough answers that an epoch takes seconds on the tiny model: the kill lands between two epochs.
LINES = [{"messages": [{"role": "user", "content": f"List the numbers from {i} on."},
                       {"role": "assistant", "content": " ".join(str(i + k) for k in range(40))}]}
         for i in range(60)]
EPOCHS = 3


def _metric_steps(oa: openai.OpenAI, job_id: str) -> list[int]:
    """The steps of the job's training-metrics events, in order (repeats kept)."""
    events = oa.fine_tuning.jobs.list_events(job_id, limit=100)  # iterating fetches every page
    return sorted(e.data["step"] for e in events
                  if e.type == "metrics" and e.data and "train_loss" in e.data and "valid_loss" not in e.data)


def _uninterrupted_total(model: Path) -> int:
    """What an uninterrupted run trains: the epochs times the trained tokens of one pass over LINES."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = prepare_dataset(tokenizer, LINES, ModelConfig.from_pretrained(model).max_position_embeddings)
    return EPOCHS * dataset.trained_tokens


@pytest.mark.timeout(300)
def test_a_killed_server_resumes_the_job_from_its_checkpoint(llama_dir: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": [KEY]}}}))
    data = "\n".join(json.dumps(line) for line in LINES).encode()
    with serve_subprocess(llama_dir, tenants, tmp_path / "data", KEY) as (proc, oa):
        file_id = oa.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune").id
        job = oa.fine_tuning.jobs.create(model=llama_dir.name, training_file=file_id, suffix="kill", seed=1,
                                         hyperparameters={"n_epochs": EPOCHS, "batch_size": 10})

        def past_a_checkpoint(_: FineTuningJob) -> bool:
            # A step after the first epoch's checkpoint is recorded: the resume redoes it.
            checkpoints = oa.fine_tuning.jobs.checkpoints.list(job.id).data
            return bool(checkpoints) and _metric_steps(oa, job.id)[-1] > checkpoints[0].step_number

        # While the second epoch trains, past its first step: kill, no clean shutdown.
        poll_job(oa, job.id, past_a_checkpoint, timeout=120)
        before = oa.fine_tuning.jobs.retrieve(job.id)
        assert before.status == "running" and before.trained_tokens
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with serve_subprocess(llama_dir, tenants, tmp_path / "data", KEY) as (_, oa):
        assert oa.files.content(file_id).read() == data
        seen: list[int] = []

        def done(j: FineTuningJob) -> bool:
            seen.append(j.trained_tokens or 0)
            return j.status in TERMINAL

        job = poll_job(oa, job.id, done, timeout=120)
        assert job.status == "succeeded", job.error
        assert min(seen) >= before.trained_tokens, "trained_tokens went back after the restart"
        assert job.trained_tokens == _uninterrupted_total(llama_dir)
        assert _metric_steps(oa, job.id) == list(range(1, 19))  # 60 / 10 x 3 epochs, each step once
        messages = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data]
        assert "Resumed from the last checkpoint" in messages
        steps = [c.step_number for c in oa.fine_tuning.jobs.checkpoints.list(job.id).data]
        assert steps == sorted(set(steps), reverse=True) and steps[0] == 18  # 60 / 10 x 3 epochs, no repeats
        reply = oa.chat.completions.create(model=job.fine_tuned_model, max_tokens=4,
                                           messages=[{"role": "user", "content": "List the numbers from 3 on."}])
        assert reply.choices[0].message.content is not None
