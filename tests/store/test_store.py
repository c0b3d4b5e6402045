"""MetadataStore: tenant isolation, pagination, the job state machine, durability and thread safety."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coserve.store import JobStatus, MetadataStore, NotFoundError
from coserve.store.blobs import ORPHAN_GRACE_S, BlobDir
from coserve.store.schema import SCHEMA_VERSION

TRAIN = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'


class FakeClock:
    """Starts at 1000 s and advances one second per reading, so every timestamp is known."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    with MetadataStore(tmp_path, clock=FakeClock()) as s:
        yield s


def _job(store: MetadataStore, tenant: str = "acme", **kwargs: object) -> str:
    file = store.files.create(tenant, "train.jsonl", "fine-tune", TRAIN)
    return store.jobs.create(tenant, "tiny-llama", file.id, **kwargs).id


def _all_pages(fetch: Callable[..., tuple[list[Any], bool]], limit: int) -> list[str]:
    ids, after, has_more = [], None, True
    while has_more:
        items, has_more = fetch(after=after, limit=limit)
        assert len(items) <= limit
        ids += [item.id for item in items]
        after = items[-1].id if items else None
    return ids


# ---------------------------------------------------------------------------------------------- files

def test_file_round_trip(store: MetadataStore, tmp_path: Path) -> None:
    f = store.files.create("acme", "train.jsonl", "fine-tune", TRAIN)
    assert f.id.startswith("file-") and len(f.id) == 5 + 24
    assert (f.bytes, f.created_at, f.status) == (len(TRAIN), 1001, "processed")
    assert store.files.get("acme", f.id) == f
    assert store.files.content("acme", f.id) == TRAIN
    assert (tmp_path / "files" / f.id).read_bytes() == TRAIN
    assert store.files.page("acme") == ([f], False)


def test_files_are_invisible_to_other_tenants(store: MetadataStore) -> None:
    f = store.files.create("acme", "train.jsonl", "fine-tune", TRAIN)
    assert store.files.get("globex", f.id) is None
    assert store.files.content("globex", f.id) is None
    assert store.files.page("globex") == ([], False)
    assert store.files.delete("globex", f.id) is False
    with pytest.raises(ValueError, match="after"):
        store.files.page("globex", after=f.id)
    assert store.files.content("acme", f.id) == TRAIN


@pytest.mark.parametrize("kwargs, match", [
    ({"filename": ""}, "filename"),
    ({"filename": "x" * 513}, "filename"),
    ({"purpose": "fine_tune"}, "purpose"),
    ({"content": "text, not bytes"}, "content"),
    ({"tenant": ""}, "tenant"),
])
def test_create_file_rejects_bad_input(store: MetadataStore, kwargs: dict, match: str) -> None:
    args = {"tenant": "acme", "filename": "a.jsonl", "purpose": "fine-tune", "content": TRAIN} | kwargs
    with pytest.raises(ValueError, match=match):
        store.files.create(**args)
    assert list((store.data_dir / "files").iterdir()) == []


def test_delete_file_removes_bytes_and_keeps_the_cursor_valid(store: MetadataStore, tmp_path: Path) -> None:
    a, b, c = (store.files.create("acme", f"{n}.jsonl", "fine-tune", TRAIN) for n in "abc")
    assert store.files.delete("acme", b.id) is True
    assert store.files.delete("acme", b.id) is False
    assert store.files.get("acme", b.id) is None and store.files.content("acme", b.id) is None
    assert not (tmp_path / "files" / b.id).exists()
    # A client that got `b` as the last item of a page before it was deleted can still page on.
    assert store.files.page("acme", after=b.id) == ([a], False)
    assert store.files.page("acme") == ([c, a], False)


def test_file_pagination_orders_and_filters(store: MetadataStore) -> None:
    files = [store.files.create("acme", f"{i}.jsonl", "fine-tune" if i % 2 else "batch", TRAIN) for i in range(7)]
    ids = [f.id for f in files]
    assert _all_pages(lambda **kw: store.files.page("acme", **kw), limit=2) == ids[::-1]
    assert _all_pages(lambda **kw: store.files.page("acme", newest_first=False, **kw), limit=3) == ids
    tuned, has_more = store.files.page("acme", purpose="fine-tune", limit=2)
    assert [f.id for f in tuned] == [ids[5], ids[3]] and has_more
    for limit in (0, 10_001, True):
        with pytest.raises(ValueError, match="limit"):
            store.files.page("acme", limit=limit)


def test_failed_row_insert_leaves_neither_row_nor_bytes(store: MetadataStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_insert(record: object, byte_budget: object = None) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store.files, "_insert_file_row", broken_insert)
    with pytest.raises(sqlite3.OperationalError):
        store.files.create("acme", "train.jsonl", "fine-tune", TRAIN)
    assert list((store.data_dir / "files").iterdir()) == []
    assert store.files.page("acme") == ([], False)


def test_crash_after_bytes_before_row_is_swept_on_reopen(tmp_path: Path) -> None:
    with MetadataStore(tmp_path) as store:
        kept = store.files.create("acme", "train.jsonl", "fine-tune", TRAIN)
    # What a process killed between the two writes leaves: bytes (maybe a temp file) and no row.
    blobs = BlobDir(tmp_path / "files")
    blobs.write("file-" + "a" * 24, b"orphan")
    (tmp_path / "files" / ("file-" + "b" * 24 + ".tmp")).write_bytes(b"half")
    # Bytes written just now may be an upload in flight in another process (its row not yet committed).
    blobs.write("file-" + "c" * 24, b"in flight")
    old = time.time() - ORPHAN_GRACE_S - 1
    for name in ("file-" + "a" * 24, "file-" + "b" * 24 + ".tmp"):
        os.utime(tmp_path / "files" / name, (old, old))
    with MetadataStore(tmp_path) as store:
        assert store.orphans_removed == ["file-" + "a" * 24, "file-" + "b" * 24 + ".tmp"]
        assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted([kept.id, "file-" + "c" * 24])
        assert store.files.page("acme") == ([kept], False)


def test_a_files_parsed_form_lives_and_goes_with_it(tmp_path: Path) -> None:
    """The parsed form beside a file's bytes: read back, kept for a file stored without one, removed with the
    file, and swept as an orphan once its file is gone (a crash between the two removals)."""
    with MetadataStore(tmp_path) as store:
        parsed = store.files.create("acme", "train.jsonl", "fine-tune", TRAIN, parsed=b'{"rows": 1}')
        older = store.files.create("acme", "old.jsonl", "fine-tune", TRAIN)
        assert store.files.parsed("acme", parsed.id) == b'{"rows": 1}'
        assert store.files.parsed("acme", older.id) is None and store.files.parsed("globex", parsed.id) is None
        assert store.files.keep_parsed("acme", older.id, b'{"rows": 2}')
        assert not store.files.keep_parsed("globex", older.id, b"x")  # another tenant's file: nothing kept
        assert store.files.parsed("acme", older.id) == b'{"rows": 2}'
        assert store.files.delete("acme", parsed.id)
        assert not (tmp_path / "files" / f"{parsed.id}.parsed.json").exists()
        orphan = tmp_path / "files" / f"{'file-' + 'd' * 24}.parsed.json"
        orphan.write_bytes(b"left by a crash")
        old = time.time() - ORPHAN_GRACE_S - 1
        os.utime(orphan, (old, old))
    with MetadataStore(tmp_path) as store:
        assert store.orphans_removed == [orphan.name]
        assert store.files.parsed("acme", older.id) == b'{"rows": 2}'


def test_blob_names_must_be_generated_file_ids(tmp_path: Path) -> None:
    blobs = BlobDir(tmp_path / "files")
    for bad in ("../metadata.sqlite3", "file-" + "A" * 24, "ftjob-" + "a" * 24, "file-abc"):
        with pytest.raises(ValueError, match="not a file id"):
            blobs.path(bad)


# ----------------------------------------------------------------------------------------------- jobs

def test_create_job_records_everything(store: MetadataStore) -> None:
    f = store.files.create("acme", "train.jsonl", "fine-tune", TRAIN)
    job = store.jobs.create("acme", "tiny-llama", f.id, validation_file=f.id, suffix="my-model_1",
                            hyperparameters={"n_epochs": 3}, method={"type": "supervised"}, seed=7,
                            metadata={"team": "nlp"}, extensions={"lora": {"r": 8, "target_modules": ["q_proj"]}})
    assert job.id.startswith("ftjob-") and job.status is JobStatus.VALIDATING_FILES
    assert store.jobs.get("acme", job.id) == job
    assert store.jobs.get("globex", job.id) is None
    assert 0 <= store.jobs.create("acme", "tiny-llama", f.id).seed <= 2_147_483_647


@pytest.mark.parametrize("kwargs, match", [
    ({"training_file": "file-" + "0" * 24}, "training_file"),
    ({"validation_file": "file-" + "0" * 24}, "validation_file"),
    ({"suffix": "a:b"}, "suffix"),
    ({"suffix": "x" * 65}, "suffix"),
    ({"seed": -1}, "seed"),
    ({"hyperparameters": [1]}, "hyperparameters"),
    ({"model": ""}, "model"),
])
def test_create_job_rejects_bad_input(store: MetadataStore, kwargs: dict, match: str) -> None:
    f = store.files.create("acme", "train.jsonl", "fine-tune", TRAIN)
    args = {"tenant": "acme", "model": "tiny-llama", "training_file": f.id} | kwargs
    with pytest.raises(ValueError, match=match):
        store.jobs.create(**args)
    assert store.jobs.page("acme") == ([], False)


def test_create_job_cannot_use_another_tenants_or_a_deleted_file(store: MetadataStore) -> None:
    theirs = store.files.create("globex", "train.jsonl", "fine-tune", TRAIN)
    with pytest.raises(ValueError, match="training_file"):
        store.jobs.create("acme", "tiny-llama", theirs.id)
    mine = store.files.create("acme", "train.jsonl", "fine-tune", TRAIN)
    store.files.delete("acme", mine.id)
    with pytest.raises(ValueError, match="training_file"):
        store.jobs.create("acme", "tiny-llama", mine.id)


def test_list_jobs_newest_first_per_tenant(store: MetadataStore) -> None:
    mine = [_job(store, "acme") for _ in range(5)]
    _job(store, "globex")
    assert _all_pages(lambda **kw: store.jobs.page("acme", **kw), limit=2) == mine[::-1]
    assert store.jobs.page("acme", after=mine[1]) == ([store.jobs.get("acme", mine[0])], False)


def test_job_lifecycle_with_pause_resume_and_restart(store: MetadataStore) -> None:
    job_id = _job(store)
    for status in ("queued", "running", "paused", "queued", "running", "queued", "running"):
        assert store.jobs.update(job_id, status=status).status is JobStatus(status)
    assert store.jobs.active()[0].id == job_id
    job = store.jobs.update(job_id, status=JobStatus.SUCCEEDED, fine_tuned_model="ft:tiny:acme::abc",
                            trained_tokens=1234, result_files=["file-" + "1" * 24])
    assert job.finished_at is not None and job.estimated_finish is None
    assert store.jobs.get("acme", job_id) == job
    assert store.jobs.active() == []


def test_a_pause_that_lands_after_the_last_step_does_not_hide_the_success(store: MetadataStore) -> None:
    job_id = _job(store)
    for status in ("queued", "running", "paused"):  # the tenant pauses while the last step completes
        store.jobs.update(job_id, status=status)
    job = store.jobs.update(job_id, status="succeeded", fine_tuned_model="ft:tiny:acme::abc")
    assert job.status is JobStatus.SUCCEEDED and job.fine_tuned_model == "ft:tiny:acme::abc"


@pytest.mark.parametrize("path", [
    ("queued", "running", "succeeded", "running"),
    ("failed", "queued"),
    ("cancelled", "running"),
    ("running",),
    ("succeeded",),
    ("queued", "succeeded"),
    ("queued", "paused", "running"),
    ("queued", "running", "validating_files"),
])
def test_illegal_transitions_are_refused_and_change_nothing(store: MetadataStore, path: tuple[str, ...]) -> None:
    job_id = _job(store)
    for status in path[:-1]:
        store.jobs.update(job_id, status=status)
    before = store.jobs.get("acme", job_id)
    with pytest.raises(ValueError, match="illegal job status transition"):
        store.jobs.update(job_id, status=path[-1], trained_tokens=5)
    assert store.jobs.get("acme", job_id) == before


def test_update_job_rejects_bad_fields(store: MetadataStore) -> None:
    job_id = _job(store)
    with pytest.raises(ValueError, match="cannot change"):
        store.jobs.update(job_id, tenant="globex")
    with pytest.raises(ValueError, match="not a valid JobStatus"):
        store.jobs.update(job_id, status="done")
    with pytest.raises(ValueError, match="error"):
        store.jobs.update(job_id, error="boom")
    with pytest.raises(NotFoundError):
        store.jobs.update("ftjob-" + "0" * 24, status="queued")
    failed = store.jobs.update(job_id, status="failed", error={"code": "invalid_n_examples",
                                                               "message": "at least 10", "param": "training_file"})
    assert store.jobs.get("acme", job_id).error == failed.error == {
        "code": "invalid_n_examples", "message": "at least 10", "param": "training_file"}


def test_concurrent_terminal_updates_have_one_winner(store: MetadataStore) -> None:
    job_id = _job(store)
    store.jobs.update(job_id, status="queued")
    store.jobs.update(job_id, status="running")
    targets = ["succeeded", "cancelled"] * 4
    won: list[str] = []
    barrier = threading.Barrier(len(targets))

    def finish(target: str) -> None:
        barrier.wait()
        try:
            store.jobs.update(job_id, status=target)
            won.append(target)
        except ValueError:
            pass

    threads = [threading.Thread(target=finish, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = store.jobs.get("acme", job_id).status.value
    assert won and set(won) == {final} and len(won) == 4


# ------------------------------------------------------------------------------ events and checkpoints

def test_events_newest_first_paginated_and_isolated(store: MetadataStore) -> None:
    job_id = _job(store)
    events = [store.events.add(job_id, f"Step {i}/5", type="metrics", data={"step": i, "train_loss": 1.0 / i})
              for i in range(1, 6)]
    assert _all_pages(lambda **kw: store.events.page("acme", job_id, **kw), limit=2) == [e.id for e in events[::-1]]
    latest, has_more = store.events.page("acme", job_id, limit=1)
    assert latest == [events[-1]] and latest[0].data == {"step": 5, "train_loss": 0.2} and has_more
    with pytest.raises(NotFoundError):
        store.events.page("globex", job_id)
    with pytest.raises(NotFoundError):
        store.events.add("ftjob-" + "0" * 24, "lost")
    with pytest.raises(ValueError, match="level"):
        store.events.add(job_id, "x", level="debug")
    with pytest.raises(ValueError, match="data"):
        store.events.add(job_id, "x", data={"loss": float("nan")})


def test_a_keyed_event_is_stored_once_per_job_across_reopens(tmp_path: Path) -> None:
    # A resumed job redoes the steps after its checkpoint: their metrics events must not be stored twice.
    with MetadataStore(tmp_path, clock=FakeClock()) as store:
        job_id, other = _job(store), _job(store)
        first = store.events.add_once(job_id, "step-3", "Step 3/6", type="metrics", data={"step": 3})
        assert first is not None
        assert store.events.add_once(job_id, "step-3", "Step 3/6 again", type="metrics", data={"step": 3}) is None
        assert store.events.add_once(other, "step-3", "Step 3/6", type="metrics") is not None  # per job
        store.events.add(job_id, "unkeyed")
        store.events.add(job_id, "unkeyed")  # events without a key are never merged
        with pytest.raises(ValueError, match="key"):
            store.events.add_once(job_id, "", "x")
    with MetadataStore(tmp_path) as store:
        assert store.events.add_once(job_id, "step-3", "Step 3/6 after a restart") is None
        events, _ = store.events.page("acme", job_id)
        assert [e.message for e in events] == ["unkeyed", "unkeyed", "Step 3/6"] and events[-1] == first


def test_a_version_1_data_dir_is_migrated_and_keeps_its_events(tmp_path: Path) -> None:
    from coserve.store.schema import MIGRATIONS

    conn = sqlite3.connect(tmp_path / MetadataStore.DB_NAME)  # what a data dir of schema version 1 holds
    with conn:
        for statement in MIGRATIONS[0].split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version (version) VALUES (1)")
    conn.close()
    with MetadataStore(tmp_path) as store:
        job_id = _job(store)
        store.events.add(job_id, "old")
        assert store.events.add_once(job_id, "step-1", "Step 1") is not None
        assert store.events.add_once(job_id, "step-1", "Step 1") is None
        assert [e.message for e in store.events.page("acme", job_id)[0]] == ["Step 1", "old"]
    conn = sqlite3.connect(tmp_path / MetadataStore.DB_NAME)
    assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    conn.close()


def test_checkpoints_highest_step_first_and_isolated(store: MetadataStore) -> None:
    job_id = _job(store)
    name = "ft:tiny:acme::abc:ckpt-step-{}"
    for step in (10, 20, 30):
        store.checkpoints.add(job_id, step, name.format(step), metrics={"step": step}, adapter_path=f"/a/{step}")
    page, has_more = store.checkpoints.page("acme", job_id, limit=2)
    assert [c.step_number for c in page] == [30, 20] and has_more
    assert [c.step_number for c in store.checkpoints.page("acme", job_id, after=page[-1].id)[0]] == [10]
    with pytest.raises(ValueError, match="already has a checkpoint"):
        store.checkpoints.add(job_id, 20, name.format("x"))
    assert store.checkpoints.get("acme", name.format(20)).adapter_path == "/a/20"
    assert store.checkpoints.get("globex", name.format(20)) is None
    with pytest.raises(NotFoundError):
        store.checkpoints.page("globex", job_id)


# --------------------------------------------------------------------------------------------- models

def test_models_base_shared_fine_tuned_private(store: MetadataStore) -> None:
    base = store.models.ensure_base("tiny-llama")
    assert store.models.ensure_base("tiny-llama") == base
    ft = store.models.register("ft:tiny-llama:acme::abc", tenant="acme", base_model="tiny-llama",
                               adapter_path="/adapters/abc", job_id="ftjob-" + "0" * 24)
    assert store.models.usable("acme") == [base, ft]
    assert store.models.usable("globex") == [base]
    assert store.models.get("globex", ft.id) is None and store.models.get("globex", base.id) == base
    assert store.models.delete("globex", ft.id) is False
    assert store.models.delete("acme", base.id) is False
    assert store.models.delete("acme", ft.id) is True
    assert store.models.get("acme", ft.id) is None and store.models.usable("acme") == [base]
    with pytest.raises(ValueError, match="never reused"):
        store.models.register(ft.id, tenant="acme")
    with pytest.raises(ValueError, match="not a base model"):
        store.models.ensure_base(ft.id)


# ----------------------------------------------------------------------------- durability and threads

def test_everything_survives_reopen(tmp_path: Path) -> None:
    with MetadataStore(tmp_path, clock=FakeClock()) as store:
        job_id = _job(store, extensions={"lora": {"r": 4}})
        store.jobs.update(job_id, status="queued")
        event = store.events.add(job_id, "Files validated")
        ckpt = store.checkpoints.add(job_id, 1, "ft:t:acme::a:ckpt-step-1", metrics={"train_loss": 2.5})
        model = store.models.register("ft:t:acme::a", tenant="acme", base_model="t")
        before = (store.files.page("acme"), store.jobs.get("acme", job_id))
    with MetadataStore(tmp_path) as store:
        assert (store.files.page("acme"), store.jobs.get("acme", job_id)) == before
        assert store.files.content("acme", before[0][0][0].id) == TRAIN
        assert store.events.page("acme", job_id) == ([event], False)
        assert store.checkpoints.page("acme", job_id) == ([ckpt], False)
        assert store.models.usable("acme") == [model]
        assert store.orphans_removed == []


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    MetadataStore(tmp_path).close()
    conn = sqlite3.connect(tmp_path / MetadataStore.DB_NAME)
    with conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    conn.close()
    with pytest.raises(ValueError, match="newer"):
        MetadataStore(tmp_path)


def test_many_threads_lose_nothing(store: MetadataStore) -> None:
    job_id = _job(store)
    per_thread, errors = 40, []

    def work(n: int) -> None:
        try:
            for i in range(per_thread):
                store.events.add(job_id, f"thread {n} event {i}")
                if i % 10 == 0:
                    store.files.create(f"tenant-{n}", f"{i}.jsonl", "fine-tune", TRAIN)
                    store.events.page("acme", job_id, limit=5)
        except Exception as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    events, has_more = store.events.page("acme", job_id, limit=10_000)
    assert len(events) == len({e.id for e in events}) == 8 * per_thread and not has_more
    for n in range(8):
        assert len(store.files.page(f"tenant-{n}")[0]) == per_thread // 10



def _write_events(data_dir: str, job_id: str, writer: str, count: int) -> None:
    """Another process's store (the gateway's or the scheduler's) adding events to the same job."""
    with MetadataStore(data_dir) as store:
        for i in range(count):
            store.events.add(job_id, f"{writer} event {i}")


def test_two_processes_write_the_same_file_without_losing_anything(tmp_path: Path) -> None:
    # The gateway and the scheduler's job manager each open the store: SQLite's lock must serialise them.
    with MetadataStore(tmp_path) as store:
        job_id = _job(store)
    count = 150
    context = multiprocessing.get_context("spawn")
    others = [context.Process(target=_write_events, args=(str(tmp_path), job_id, f"process {n}", count))
              for n in range(2)]
    for process in others:
        process.start()
    _write_events(str(tmp_path), job_id, "main", count)
    for process in others:
        process.join(60)
        assert process.exitcode == 0
    with MetadataStore(tmp_path) as store:
        events, _ = store.events.page("acme", job_id, limit=10_000)
    messages = {event.message for event in events}
    assert len(events) == len(messages) == 3 * count
    assert {f"{w} event {count - 1}" for w in ("main", "process 0", "process 1")} <= messages

def test_records_pickle(store: MetadataStore) -> None:
    job_id = _job(store)
    job = store.jobs.get("acme", job_id)
    assert pickle.loads(pickle.dumps(job)) == job
