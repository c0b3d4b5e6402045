"""Storage usage measured from the real SQLite file and the disk: files, adapter folders, model counts,
reservations of active jobs (older first), and a deleted model's folder removed (also after a crash)."""

from __future__ import annotations

import threading
from pathlib import Path

from coserve.jobs.storage import JobStorage
from coserve.store import JobStatus, MetadataStore, StorageLimitError
from coserve.store.usage import RESERVED_MODELS_KEY
from coserve.tenancy.quotas import TenantLimits

TRAIN = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'


def write_adapter(store: MetadataStore, job_id: str, name: str, size: int) -> str:
    folder = store.usage.job_dir(job_id) / name
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"x" * size)
    return str(folder)


def test_usage_counts_files_adapters_models_and_reservations(tmp_path: Path) -> None:
    with MetadataStore(tmp_path) as store:
        file_id = store.files.create("acme", "t.jsonl", "fine-tune", TRAIN).id
        store.files.create("globex", "t.jsonl", "fine-tune", TRAIN * 3)
        job = store.jobs.create("acme", "base", file_id, extensions={RESERVED_MODELS_KEY: 3})
        path = write_adapter(store, job.id, "ckpt-step-1", 1000)
        store.models.register("ft:base:acme::1:ckpt-step-1", tenant="acme", adapter_path=path, job_id=job.id)
        usage = store.usage.of("acme")
        assert (usage.file_bytes, usage.adapter_bytes, usage.fine_tuned_models, usage.reserved_models) == \
            (len(TRAIN), 1000, 1, 2)
        store.jobs.update(job.id, status=JobStatus.CANCELLED)
        assert store.usage.of("acme").reserved_models == 0  # a job that ended holds no reservation
        assert store.usage.of("globex").file_bytes == 3 * len(TRAIN)

    with MetadataStore(tmp_path) as store:  # nothing is kept in memory: a new process sees the same
        assert store.usage.of("acme").adapter_bytes == 1000
        assert store.models.delete("acme", "ft:base:acme::1:ckpt-step-1")
        assert not Path(path).exists() and not store.usage.job_dir(job.id).exists()
        assert store.usage.of("acme").adapter_bytes == 0 and store.usage.of("acme").fine_tuned_models == 0


def test_a_folder_outside_the_adapters_dir_is_never_removed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with MetadataStore(tmp_path / "data") as store:
        store.models.register("ft:base:acme::x", tenant="acme", adapter_path=str(elsewhere))
        assert store.models.delete("acme", "ft:base:acme::x")
    assert elsewhere.is_dir()


def test_a_crash_between_delete_and_removal_is_swept_on_open(tmp_path: Path) -> None:
    with MetadataStore(tmp_path) as store:
        job = store.jobs.create("acme", "base", store.files.create("acme", "t.jsonl", "fine-tune", TRAIN).id)
        path = write_adapter(store, job.id, "final", 10)
        store.models.register("ft:base:acme::y", tenant="acme", adapter_path=path, job_id=job.id)
        store.usage.remove_adapter = lambda _path: False  # type: ignore[method-assign]  # the crash
        assert store.models.delete("acme", "ft:base:acme::y")
        assert Path(path).is_dir()
    with MetadataStore(tmp_path) as store:
        assert store.deleted_adapters_removed == [path]
        assert not Path(path).exists()


def test_validation_checks_the_reservation_against_older_jobs_only(tmp_path: Path) -> None:
    with MetadataStore(tmp_path) as store:
        file_id = store.files.create("acme", "t.jsonl", "fine-tune", TRAIN).id
        # Two jobs created at once, each admitted by the gateway with an estimate of 2 models; the file
        # resolves to 2 epochs (3 models) once tokenized, and only 5 fit.
        older = store.jobs.create("acme", "base", file_id, extensions={RESERVED_MODELS_KEY: 2})
        newer = store.jobs.create("acme", "base", file_id, extensions={RESERVED_MODELS_KEY: 2})
        storage = JobStorage(store, {"acme": TenantLimits(max_fine_tuned_models=5)})
        assert storage.reserve(older, n_epochs=2) is None  # 3, beside nothing older
        assert store.jobs.get("acme", older.id).extensions[RESERVED_MODELS_KEY] == 3
        refusal = storage.reserve(newer, n_epochs=2)  # 3 more beside the older job's 3: over 5
        assert refusal is not None and refusal.limit == "max_fine_tuned_models"
        assert store.jobs.get("acme", newer.id).extensions[RESERVED_MODELS_KEY] == 2


def test_concurrent_uploads_never_pass_the_byte_budget(tmp_path: Path) -> None:
    """The budget is checked in the transaction that records the file: of 8 uploads racing for room for 3,
    exactly 3 are stored, and the others leave no bytes behind."""
    with MetadataStore(tmp_path) as store:
        outcomes: list[str] = []
        start = threading.Barrier(8)

        def upload() -> None:
            start.wait()
            try:
                store.files.create("acme", "t.jsonl", "fine-tune", TRAIN, byte_budget=3 * len(TRAIN))
                outcomes.append("stored")
            except StorageLimitError:
                outcomes.append("refused")

        threads = [threading.Thread(target=upload) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == ["refused"] * 5 + ["stored"] * 3
        assert store.usage.of("acme").file_bytes == 3 * len(TRAIN)
        assert len(list((tmp_path / "files").iterdir())) == 3
