"""Events and checkpoints of fine-tuning jobs. The scheduler adds them (no tenant: it owns every job);
tenants list only those of their own jobs."""

from __future__ import annotations

import sqlite3
from typing import Any

from coserve.actors.store._base import StoreCore, from_row, to_json
from coserve.actors.store.records import (EVENT_LEVELS, EVENT_TYPES, CheckpointRecord, EventRecord, NotFoundError,
                                          check_choice, new_id)

_EVENT_JSON = frozenset({"data"})
_CHECKPOINT_JSON = frozenset({"metrics"})


class EventsMixin(StoreCore):
    """Add and list job events and checkpoints."""

    def _require_job(self, conn: sqlite3.Connection, job_id: str, tenant: str | None = None) -> None:
        if tenant is None:
            row = conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone()
        else:
            row = conn.execute("SELECT 1 FROM jobs WHERE id = ? AND tenant = ?", (job_id, tenant)).fetchone()
        if row is None:
            raise NotFoundError(f"no fine-tuning job {job_id!r}")

    def add_event(self, job_id: str, message: str, *, level: str = "info", type: str = "message",
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
        check_choice("level", level, EVENT_LEVELS)
        check_choice("type", type, EVENT_TYPES)
        if not isinstance(message, str):
            raise ValueError(f"message must be a string, got {message!r}")
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"data must be a dict or None, got {data!r}")
        event = EventRecord(id=new_id("ftevent"), job_id=job_id, created_at=self._now(), level=level,
                            message=message, type=type, data=data)
        encoded = to_json("data", data)
        with self._write() as conn:
            self._require_job(conn, job_id)
            conn.execute("INSERT INTO events (id, job_id, created_at, level, message, type, data) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (event.id, job_id, event.created_at, level, message, type, encoded))
        return event

    def list_events(self, tenant: str, job_id: str, *, after: str | None = None,
                    limit: int = 20) -> tuple[list[EventRecord], bool]:
        """A page of the events of `tenant`'s job `job_id`, newest first, and whether more follow.

        Raises:
            NotFoundError: no job `job_id` of `tenant`.
            ValueError: bad limit, or `after` is not an event of this job.
        """
        with self._read() as conn:
            self._require_job(conn, job_id, tenant)
        rows, has_more = self._page("events", "job_id = ?", (job_id,), after=after, limit=limit)
        return [from_row(EventRecord, row, _EVENT_JSON) for row in rows], has_more

    def add_checkpoint(self, job_id: str, step_number: int, fine_tuned_model_checkpoint: str, *,
                       metrics: dict[str, Any] | None = None, adapter_path: str | None = None) -> CheckpointRecord:
        """Record that job `job_id` saved its adapter at `step_number` (write the adapter first).

        Args:
            fine_tuned_model_checkpoint: the servable id, `ft:{base}:{tenant}:{suffix}:{id}:ckpt-step-{N}`.
            metrics: `{"step", "train_loss", "valid_loss", ...}`.
            adapter_path: the PEFT folder of this checkpoint.

        Raises:
            NotFoundError: no job `job_id`.
            ValueError: negative step, or this job already has a checkpoint at that step or with that name.
        """
        if not isinstance(step_number, int) or isinstance(step_number, bool) or step_number < 0:
            raise ValueError(f"step_number must be an integer >= 0, got {step_number!r}")
        if not isinstance(fine_tuned_model_checkpoint, str) or not fine_tuned_model_checkpoint:
            raise ValueError(f"fine_tuned_model_checkpoint must be a non-empty string, "
                             f"got {fine_tuned_model_checkpoint!r}")
        checkpoint = CheckpointRecord(id=new_id("ftckpt"), job_id=job_id, step_number=step_number,
                                      fine_tuned_model_checkpoint=fine_tuned_model_checkpoint,
                                      metrics=dict(metrics or {}), created_at=self._now(), adapter_path=adapter_path)
        encoded = to_json("metrics", checkpoint.metrics)
        with self._write() as conn:
            self._require_job(conn, job_id)
            try:
                conn.execute("INSERT INTO checkpoints (id, job_id, step_number, fine_tuned_model_checkpoint, "
                             "metrics, created_at, adapter_path) VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (checkpoint.id, job_id, step_number, fine_tuned_model_checkpoint, encoded,
                              checkpoint.created_at, adapter_path))
            except sqlite3.IntegrityError:
                raise ValueError(f"job {job_id!r} already has a checkpoint at step {step_number} or named "
                                 f"{fine_tuned_model_checkpoint!r}") from None
        return checkpoint

    def list_checkpoints(self, tenant: str, job_id: str, *, after: str | None = None,
                         limit: int = 10) -> tuple[list[CheckpointRecord], bool]:
        """A page of the checkpoints of `tenant`'s job `job_id`, highest step first, and whether more follow.

        Raises:
            NotFoundError: no job `job_id` of `tenant`.
            ValueError: bad limit, or `after` is not a checkpoint of this job.
        """
        with self._read() as conn:
            self._require_job(conn, job_id, tenant)
        rows, has_more = self._page("checkpoints", "job_id = ?", (job_id,), after=after, limit=limit,
                                    order="step_number")
        return [from_row(CheckpointRecord, row, _CHECKPOINT_JSON) for row in rows], has_more

    def get_checkpoint(self, tenant: str, fine_tuned_model_checkpoint: str) -> CheckpointRecord | None:
        """The checkpoint servable as `fine_tuned_model_checkpoint`; None unless it is of `tenant`'s job."""
        with self._read() as conn:
            row = conn.execute("SELECT c.* FROM checkpoints c JOIN jobs j ON j.id = c.job_id "
                               "WHERE c.fine_tuned_model_checkpoint = ? AND j.tenant = ?",
                               (fine_tuned_model_checkpoint, tenant)).fetchone()
        return None if row is None else from_row(CheckpointRecord, row, _CHECKPOINT_JSON)
