"""Per-tenant storage quotas (`max_stored_bytes`, `max_fine_tuned_models`) through the real `--local`
server, the official client and the real SQLite file: uploads refused at the limit and accepted again once
a file is deleted (also after a restart), jobs refused at creation when the models they would write do not
fit, a deleted fine-tuned model's folder gone from disk with its count, a checkpoint over the byte quota
not kept and its job failed with the code, a model an active job resumes or trains from not deletable."""

from __future__ import annotations

import io
import json
from pathlib import Path

import openai
import pytest

from coserve.store import MetadataStore
from local_server import local_server, poll_job

KEY, OTHER = "sk-storage-acme-0123456789", "sk-storage-globex-0123456789"
LINES = [{"messages": [{"role": "user", "content": f"Say {i}"},
                       {"role": "assistant", "content": f"{i} and {i + 1}."}]} for i in range(12)]
DATA = "\n".join(json.dumps(line) for line in LINES).encode()


def upload(oa: openai.OpenAI) -> str:
    return oa.files.create(file=("train.jsonl", io.BytesIO(DATA)), purpose="fine-tune").id


def usage(root: Path, tenant: str = "acme"):  # type: ignore[no-untyped-def]
    """The tenant's usage as the store measures it (a second connection to the server's SQLite file)."""
    with MetadataStore(root / "data") as store:
        return store.usage.of(tenant)


def test_uploads_until_refused_delete_frees_room_also_after_a_restart(llama_dir: Path, tmp_path: Path) -> None:
    tenants = {"acme": {"api_keys": [KEY], "limits": {"max_stored_bytes": 2 * len(DATA) + len(DATA) // 2}},
               "globex": {"api_keys": [OTHER]}}
    with local_server(llama_dir, tmp_path, tenants) as srv:
        oa = srv.client(KEY)
        first, second = upload(oa), upload(oa)
        with pytest.raises(openai.PermissionDeniedError) as refused:  # 403: the client does not retry
            upload(oa)
        assert refused.value.status_code == 403
        assert refused.value.body == {"message": refused.value.body["message"], "type": "insufficient_quota",
                                      "param": "file", "code": "storage_quota_exceeded"}
        assert "max_stored_bytes" in refused.value.body["message"]
        assert {f.id for f in oa.files.list()} == {first, second}
        kept = sorted(p.name for p in (tmp_path / "data" / "files").iterdir())  # nothing of the refused upload
        assert kept == sorted([first, second, f"{first}.parsed.json", f"{second}.parsed.json"])
        upload(srv.client(OTHER))  # another tenant's room is its own

        assert oa.files.delete(first).deleted
        assert usage(tmp_path).file_bytes == len(DATA)
        third = upload(oa)
        assert {f.id for f in oa.files.list()} == {second, third}

    # Usage comes from the store, not a counter: a restarted server still refuses.
    with local_server(llama_dir, tmp_path, tenants) as srv:
        oa = srv.client(KEY)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            upload(oa)
        assert refused.value.code == "storage_quota_exceeded"
        oa.files.delete(second)
        upload(oa)


def test_model_quota_reserves_at_creation_and_delete_frees_folder_and_count(llama_dir: Path,
                                                                             tmp_path: Path) -> None:
    tenants = {"acme": {"api_keys": [KEY], "limits": {"max_fine_tuned_models": 2}}}
    with local_server(llama_dir, tmp_path, tenants) as srv:
        oa = srv.client(KEY)
        file_id = upload(oa)
        # Two epochs write two checkpoints and the final model: 3 > 2, refused before anything runs.
        with pytest.raises(openai.PermissionDeniedError) as refused:
            oa.fine_tuning.jobs.create(model=srv.base, training_file=file_id,
                                       hyperparameters={"n_epochs": 2, "batch_size": 4})
        assert refused.value.code == "model_quota_exceeded"
        assert refused.value.body["type"] == "insufficient_quota"
        assert "max_fine_tuned_models=2" in refused.value.body["message"]
        with pytest.raises(openai.PermissionDeniedError) as refused:  # "auto": 9 epochs for 12 examples
            oa.fine_tuning.jobs.create(model=srv.base, training_file=file_id)
        assert refused.value.code == "model_quota_exceeded" and "10 fine-tuned models" in refused.value.body["message"]
        assert not oa.fine_tuning.jobs.list().data

        job = oa.fine_tuning.jobs.create(model=srv.base, training_file=file_id, suffix="one",
                                         hyperparameters={"n_epochs": 1, "batch_size": 4})
        # Its two models are reserved from creation: a second job is refused while it runs, and after.
        with pytest.raises(openai.PermissionDeniedError) as refused:
            oa.fine_tuning.jobs.create(model=srv.base, training_file=file_id, hyperparameters={"n_epochs": 1})
        assert refused.value.code == "model_quota_exceeded"
        done = poll_job(oa, job.id, timeout=120)
        assert done.status == "succeeded", done.error
        (ckpt,) = oa.fine_tuning.jobs.checkpoints.list(job.id).data
        owned = {m.id for m in oa.models.list().data if m.id.startswith("ft:")}
        assert owned == {done.fine_tuned_model, ckpt.fine_tuned_model_checkpoint}
        with pytest.raises(openai.PermissionDeniedError):
            oa.fine_tuning.jobs.create(model=srv.base, training_file=file_id, hyperparameters={"n_epochs": 1})

        job_dir = tmp_path / "data" / "adapters" / job.id
        before = usage(tmp_path)
        assert before.fine_tuned_models == 2 and before.adapter_bytes > 0
        assert oa.models.delete(done.fine_tuned_model).deleted
        assert not (job_dir / "final").exists() and (job_dir / f"ckpt-step-{ckpt.step_number}").is_dir()
        after = usage(tmp_path)
        assert after.fine_tuned_models == 1 and 0 < after.adapter_bytes < before.adapter_bytes
        with pytest.raises(openai.NotFoundError):
            oa.chat.completions.create(model=done.fine_tuned_model, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
        oa.models.delete(ckpt.fine_tuned_model_checkpoint)
        assert not job_dir.exists()
        assert usage(tmp_path).fine_tuned_models == 0 and usage(tmp_path).adapter_bytes == 0
        assert not [m.id for m in oa.models.list().data if m.id.startswith("ft:")]

        again = oa.fine_tuning.jobs.create(model=srv.base, training_file=file_id,
                                           hyperparameters={"n_epochs": 1, "batch_size": 4})
        assert poll_job(oa, again.id, timeout=120).status == "succeeded"


def _jsonl_of(size: int) -> bytes:
    """A valid fine-tuning JSONL of exactly `size` bytes (at least one line's worth)."""
    line = json.dumps(LINES[0])
    lines = [line] * max(1, size // (len(line) + 1))
    data = "\n".join(lines)
    pad = size - len(data)  # spaces after a line's JSON are still valid JSON
    return (data + " " * pad).encode() if pad >= 0 else data.encode()


def _checkpoint_bytes(llama_dir: Path, tmp_path: Path) -> int:
    """What one checkpoint of the 12-line job takes on disk (same shapes at every step)."""
    (tmp_path / "measure").mkdir()
    with local_server(llama_dir, tmp_path / "measure", {"acme": {"api_keys": [KEY]}}) as srv:
        oa = srv.client(KEY)
        job = oa.fine_tuning.jobs.create(model=srv.base, training_file=upload(oa),
                                         hyperparameters={"n_epochs": 1, "batch_size": 4})
        assert poll_job(oa, job.id, timeout=120).status == "succeeded"
    folder = tmp_path / "measure" / "data" / "adapters" / job.id / "ckpt-step-3"
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_checkpoint_over_the_byte_quota_is_not_kept_and_fails_its_job(llama_dir: Path, tmp_path: Path) -> None:
    ckpt_bytes = _checkpoint_bytes(llama_dir, tmp_path)
    # Room for the file and one checkpoint and a half: the second epoch's checkpoint passes the limit.
    limit = len(DATA) + ckpt_bytes + ckpt_bytes // 2
    tenants = {"acme": {"api_keys": [KEY], "limits": {"max_stored_bytes": limit}}}
    with local_server(llama_dir, tmp_path, tenants) as srv:
        oa = srv.client(KEY)
        job = oa.fine_tuning.jobs.create(model=srv.base, training_file=upload(oa),
                                         hyperparameters={"n_epochs": 3, "batch_size": 4})
        done = poll_job(oa, job.id, timeout=120)
        assert done.status == "failed"
        assert done.error is not None and done.error.code == "storage_quota_exceeded", done.error
        assert f"max_stored_bytes={limit}" in done.error.message
        events = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data]
        assert any(m.startswith("Job failed: the adapter saved at step 6 was not kept") for m in events), events
        # The first checkpoint stays, whole and servable; the second is gone from disk and from the models.
        (ckpt,) = oa.fine_tuning.jobs.checkpoints.list(job.id).data
        assert ckpt.step_number == 3
        assert sorted(p.name for p in (tmp_path / "data" / "adapters" / job.id).iterdir()) == ["ckpt-step-3"]
        assert [m.id for m in oa.models.list().data if m.id.startswith("ft:")] == [ckpt.fine_tuned_model_checkpoint]
        assert oa.chat.completions.create(model=ckpt.fine_tuned_model_checkpoint, max_tokens=2,
                                          messages=[{"role": "user", "content": "Say 1"}]).choices
        stored = usage(tmp_path).stored_bytes
        assert stored <= limit
        with pytest.raises(openai.PermissionDeniedError) as refused:  # a file of the room left + 1 byte
            oa.files.create(file=("big.jsonl", io.BytesIO(_jsonl_of(limit - stored + 1))), purpose="fine-tune")
        assert refused.value.code == "storage_quota_exceeded"


def test_a_model_an_active_job_needs_cannot_be_deleted(llama_dir: Path, tmp_path: Path) -> None:
    with local_server(llama_dir, tmp_path, {"acme": {"api_keys": [KEY]}}) as srv:
        oa = srv.client(KEY)
        job = oa.fine_tuning.jobs.create(model=srv.base, training_file=upload(oa),
                                         hyperparameters={"n_epochs": 50, "batch_size": 4})
        poll_job(oa, job.id, lambda j: bool(oa.fine_tuning.jobs.checkpoints.list(j.id).data), timeout=120)
        ckpt = oa.fine_tuning.jobs.checkpoints.list(job.id).data[-1]
        with pytest.raises(openai.BadRequestError) as refused:
            oa.models.delete(ckpt.fine_tuned_model_checkpoint)
        assert refused.value.code == "model_in_use" and refused.value.body["param"] == "model"
        # A second job trains on from that checkpoint: it stays in use after its own job ends.
        follow = oa.fine_tuning.jobs.create(model=ckpt.fine_tuned_model_checkpoint, training_file=upload(oa),
                                            hyperparameters={"n_epochs": 50, "batch_size": 4})
        oa.fine_tuning.jobs.cancel(job.id)
        poll_job(oa, job.id, timeout=60)
        with pytest.raises(openai.BadRequestError) as refused:
            oa.models.delete(ckpt.fine_tuned_model_checkpoint)
        assert refused.value.code == "model_in_use" and follow.id in refused.value.body["message"]
        oa.fine_tuning.jobs.cancel(follow.id)
        poll_job(oa, follow.id, timeout=60)
        path = tmp_path / "data" / "adapters" / job.id / f"ckpt-step-{ckpt.step_number}"
        assert path.is_dir()
        assert oa.models.delete(ckpt.fine_tuned_model_checkpoint).deleted
        assert not path.exists()
