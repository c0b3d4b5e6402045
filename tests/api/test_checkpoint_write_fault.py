"""A checkpoint write that fails (disk full, simulated below the atomic writer) fails its job with an event
that says why, leaves the previous checkpoint and the store consistent, and costs the requests served
beside it nothing; through the real `--local` server and the official client."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import pytest

import coserve.trainer.checkpoint as checkpoint_module
from local_server import local_server, poll_job, upload_jsonl

KEY = "sk-fault-tenant-0123456789"
LINES = [{"messages": [{"role": "user", "content": f"Say {i}"},
                       {"role": "assistant", "content": f"{i} and {i + 1}."}]} for i in range(12)]


def test_disk_full_at_the_second_checkpoint(llama_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = checkpoint_module._write_contents
    calls: list[int] = []
    lock = threading.Lock()

    def write_then_fill_the_disk(folder: Path, *args: Any) -> None:
        with lock:
            calls.append(1)
            nth = len(calls)
        real_write(folder, *args)  # the files are there: the failure comes while the folder is half done
        if nth == 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "_write_contents", write_then_fill_the_disk)
    with local_server(llama_dir, tmp_path, {"acme": {"api_keys": [KEY]}}) as srv:
        oa = srv.client(KEY)
        job = oa.fine_tuning.jobs.create(model=srv.base, training_file=upload_jsonl(oa, LINES),
                                         hyperparameters={"n_epochs": 4, "batch_size": 4})
        done = poll_job(oa, job.id, timeout=120)
        assert done.status == "failed", done
        assert done.error is not None and done.error.code == "checkpoint_write_failed", done.error
        assert "No space left on device" in done.error.message
        events = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data]
        assert any("could not write the checkpoint of step 6" in m for m in events), events

        # The store: the first checkpoint, whole and servable; no half-written folder beside it.
        (ckpt,) = oa.fine_tuning.jobs.checkpoints.list(job.id).data
        assert ckpt.step_number == 3
        reply = oa.chat.completions.create(model=ckpt.fine_tuned_model_checkpoint, max_tokens=3,
                                           messages=[{"role": "user", "content": "Say 1"}])
        assert reply.choices[0].message.content is not None
        job_dir = tmp_path / "data" / "adapters" / job.id
        assert sorted(p.name for p in job_dir.iterdir()) == ["ckpt-step-3"], list(job_dir.iterdir())
        assert done.fine_tuned_model is None
        assert not [m.id for m in oa.models.list().data if m.id.startswith("ft:") and ":ckpt-" not in m.id]
        # The server goes on: chat on the base model and a new job that trains to the end.
        assert oa.chat.completions.create(model=srv.base, max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}]).choices
        again = oa.fine_tuning.jobs.create(model=srv.base, training_file=upload_jsonl(oa, LINES),
                                           hyperparameters={"n_epochs": 1, "batch_size": 4})
        assert poll_job(oa, again.id, timeout=120).status == "succeeded"
