"""`MetadataStore`: the one writer of the data dir's SQLite file (files, jobs, events, checkpoints, models)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from coserve.actors.store.events import EventsMixin
from coserve.actors.store.files import FilesMixin
from coserve.actors.store.jobs import JobsMixin
from coserve.actors.store.models import ModelsMixin


class MetadataStore(FilesMixin, JobsMixin, EventsMixin, ModelsMixin):
    """Durable metadata of the platform in `<data_dir>/metadata.sqlite3`, upload bytes in `<data_dir>/files/`.

    A plain class: Ray wraps it (`ray.remote(MetadataStore)`) in cluster mode so that exactly one process
    writes the file; in local mode it is used directly. Every method is safe to call from many threads.
    Every tenant-facing read takes the tenant and treats another tenant's object as absent (None, or
    `NotFoundError`), so the gateway answers 404 without a separate ownership check.

    Args:
        data_dir: the data folder (created if missing).
        clock: seconds since the epoch for `created_at` and friends (tests inject a fake one).

    Raises:
        ValueError: the database was written by a newer coserve.
    """

    def __init__(self, data_dir: str | Path, clock: Callable[[], float] = time.time) -> None:
        super().__init__(data_dir, clock)
        # A crash between writing an upload's bytes and its row (or between a delete's row and its bytes)
        # leaves bytes that no row reaches; nothing can serve them, and this reclaims the space.
        self.orphans_removed = self._blobs.sweep(self._live_file_ids())
