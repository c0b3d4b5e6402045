"""`MetadataStore`: the data dir's SQLite file (files, jobs, events, checkpoints, models, stored responses) and
upload bytes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from coserve.store._base import Database
from coserve.store.checkpoints import CheckpointTable
from coserve.store.events import EventTable
from coserve.store.files import FileTable
from coserve.store.jobs import JobTable
from coserve.store.models import ModelTable
from coserve.store.responses import ResponseTable
from coserve.store.usage import UsageTable


class MetadataStore:
    """Durable metadata of the platform in `<data_dir>/metadata.sqlite3`, upload bytes in `<data_dir>/files/`.

    One object per table (`files`, `jobs`, `events`, `checkpoints`, `models`, `responses`) over one `Database`, and
    `usage`: what each tenant stores (for the storage quotas). Every
    method is safe to call from many threads, and from several processes on the data dir's host: the
    gateway and the scheduler's job manager each open the store (SQLite's file lock serialises their writes,
    see `Database`). Every tenant-facing read takes the tenant and treats another tenant's object as absent
    (None, or `NotFoundError`), so the gateway answers 404 without a separate ownership check.

    Args:
        data_dir: the data folder (created if missing).
        clock: seconds since the epoch for `created_at` and friends (tests inject a fake one).

    Raises:
        ValueError: the database was written by a newer coserve.
    """

    DB_NAME = Database.DB_NAME

    def __init__(self, data_dir: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.db = Database(data_dir, clock)
        self.data_dir = self.db.data_dir
        self.files = FileTable(self.db)
        self.jobs = JobTable(self.db)
        self.events = EventTable(self.db)
        self.checkpoints = CheckpointTable(self.db)
        self.usage = UsageTable(self.db)
        self.models = ModelTable(self.db, self.usage)
        self.responses = ResponseTable(self.db)
        # A crash between writing an upload's bytes and its row (or between a delete's row and its bytes)
        # leaves bytes that no row reaches; nothing can serve them, and this reclaims the space.
        self.orphans_removed = self.db.blobs.sweep(self.files.live_ids())
        self.deleted_adapters_removed = self.usage.sweep_deleted()

    def close(self) -> None:
        """Close the database; the store must not be used afterwards."""
        self.db.close()

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
