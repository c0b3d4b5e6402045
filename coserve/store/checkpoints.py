"""Checkpoints of fine-tuning jobs: the scheduler records one per saved adapter (no tenant: it owns every
job); tenants list and resolve only those of their own jobs."""

from __future__ import annotations

import sqlite3
from typing import Any

from coserve.store._base import Database, from_row, to_json
from coserve.store.jobs import require_job
from coserve.store.records import CheckpointRecord, new_id

_CHECKPOINT_JSON = frozenset({"metrics"})


class CheckpointTable:
    """Add, list and resolve job checkpoints."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, job_id: str, step_number: int, fine_tuned_model_checkpoint: str, *,
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
                                      metrics=dict(metrics or {}), created_at=self._db.now(), adapter_path=adapter_path)
        encoded = to_json("metrics", checkpoint.metrics)
        with self._db.write() as conn:
            require_job(conn, job_id)
            try:
                conn.execute("INSERT INTO checkpoints (id, job_id, step_number, fine_tuned_model_checkpoint, "
                             "metrics, created_at, adapter_path) VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (checkpoint.id, job_id, step_number, fine_tuned_model_checkpoint, encoded,
                              checkpoint.created_at, adapter_path))
            except sqlite3.IntegrityError:
                raise ValueError(f"job {job_id!r} already has a checkpoint at step {step_number} or named "
                                 f"{fine_tuned_model_checkpoint!r}") from None
        return checkpoint

    def page(self, tenant: str, job_id: str, *, after: str | None = None,
                         limit: int = 10) -> tuple[list[CheckpointRecord], bool]:
        """A page of the checkpoints of `tenant`'s job `job_id`, highest step first, and whether more follow.

        Raises:
            NotFoundError: no job `job_id` of `tenant`.
            ValueError: bad limit, or `after` is not a checkpoint of this job.
        """
        with self._db.read() as conn:
            require_job(conn, job_id, tenant)
        rows, has_more = self._db.page("checkpoints", "job_id = ?", (job_id,), after=after, limit=limit,
                                    order="step_number")
        return [from_row(CheckpointRecord, row, _CHECKPOINT_JSON) for row in rows], has_more

    def get(self, tenant: str, fine_tuned_model_checkpoint: str) -> CheckpointRecord | None:
        """The checkpoint servable as `fine_tuned_model_checkpoint`; None unless it is of `tenant`'s job."""
        with self._db.read() as conn:
            row = conn.execute("SELECT c.* FROM checkpoints c JOIN jobs j ON j.id = c.job_id "
                               "WHERE c.fine_tuned_model_checkpoint = ? AND j.tenant = ?",
                               (fine_tuned_model_checkpoint, tenant)).fetchone()
        return None if row is None else from_row(CheckpointRecord, row, _CHECKPOINT_JSON)
