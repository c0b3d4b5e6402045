"""Events of fine-tuning jobs. The scheduler adds them (no tenant: it owns every job); tenants list only
those of their own jobs."""

from __future__ import annotations

from typing import Any

from coserve.store._base import Database, from_row, to_json
from coserve.store.jobs import require_job
from coserve.store.records import EVENT_LEVELS, EVENT_TYPES, EventRecord, check_choice, new_id

_EVENT_JSON = frozenset({"data"})


class EventTable:
    """Add and list job events."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, job_id: str, message: str, *, level: str = "info", type: str = "message",
                  data: dict[str, Any] | None = None) -> EventRecord:
        """Append an event to job `job_id`.

        Args:
            level: "info", "warn" or "error".
            type: "message", or "metrics" with `data` such as `{"step", "train_loss", "valid_loss",
                "total_steps"}`.

        Raises:
            NotFoundError: no job `job_id`.
            ValueError: bad level or type, `data` not a JSON-able dict, `message` not a string.
        """
        event = self._insert(job_id, message, level, type, data, None)
        assert event is not None  # only a keyed event can already be there
        return event

    def add_once(self, job_id: str, key: str, message: str, *, level: str = "info", type: str = "message",
                 data: dict[str, Any] | None = None) -> EventRecord | None:
        """Append an event that job `job_id` has at most once per `key` (e.g. `step-7`): the metrics of a
        step that a resumed job redoes are stored once. Returns None, storing nothing, when the job
        already has an event with this key. Arguments and errors as `add`, plus a non-string key.
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        return self._insert(job_id, message, level, type, data, key)

    def _insert(self, job_id: str, message: str, level: str, type: str, data: dict[str, Any] | None,
                key: str | None) -> EventRecord | None:
        check_choice("level", level, EVENT_LEVELS)
        check_choice("type", type, EVENT_TYPES)
        if not isinstance(message, str):
            raise ValueError(f"message must be a string, got {message!r}")
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"data must be a dict or None, got {data!r}")
        event = EventRecord(id=new_id("ftevent"), job_id=job_id, created_at=self._db.now(), level=level,
                            message=message, type=type, data=data)
        encoded = to_json("data", data)
        with self._db.write() as conn:
            require_job(conn, job_id)
            # Checked in the write transaction: two writers of one key cannot both pass (the unique
            # index backs it).
            if key is not None and conn.execute("SELECT 1 FROM events WHERE job_id = ? AND dedup_key = ?",
                                                (job_id, key)).fetchone() is not None:
                return None
            conn.execute("INSERT INTO events (id, job_id, created_at, level, message, type, data, dedup_key) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (event.id, job_id, event.created_at, level, message, type, encoded, key))
        return event

    def page(self, tenant: str, job_id: str, *, after: str | None = None,
                    limit: int = 20) -> tuple[list[EventRecord], bool]:
        """A page of the events of `tenant`'s job `job_id`, newest first, and whether more follow.

        Raises:
            NotFoundError: no job `job_id` of `tenant`.
            ValueError: bad limit, or `after` is not an event of this job.
        """
        with self._db.read() as conn:
            require_job(conn, job_id, tenant)
        rows, has_more = self._db.page("events", "job_id = ?", (job_id,), after=after, limit=limit)
        return [from_row(EventRecord, row, _EVENT_JSON) for row in rows], has_more
