"""Fine-tuning jobs: creation (checked against the tenant's files), tenant-scoped reads, and status updates
that follow the job state machine (`records.ALLOWED_TRANSITIONS`)."""

from __future__ import annotations

import secrets
import sqlite3
from typing import Any

from coserve.store._base import Database, check_tenant, from_row, to_json
from coserve.store.records import JobRecord, JobStatus, NotFoundError, check_suffix, check_transition, new_id

JOB_JSON = frozenset({"hyperparameters", "method", "metadata", "error", "result_files", "extensions"})
_JOB_CONVERT = {"status": JobStatus}

MUTABLE_JOB_FIELDS = frozenset({"status", "fine_tuned_model", "trained_tokens", "error", "finished_at",
                                "estimated_finish", "result_files", "hyperparameters", "method", "extensions"})
"""What `JobTable.update` may change; everything else is fixed when the job is created."""

_JOB_COLUMNS = ("id", "tenant", "model", "training_file", "validation_file", "hyperparameters", "method",
                "suffix", "seed", "metadata", "status", "fine_tuned_model", "trained_tokens", "error",
                "created_at", "finished_at", "estimated_finish", "result_files", "extensions")
_INSERT_JOB = (f"INSERT INTO jobs ({', '.join(_JOB_COLUMNS)}) "
               f"VALUES ({', '.join('?' for _ in _JOB_COLUMNS)})")
_MAX_SEED = 2_147_483_647


def _check_dict(name: str, value: Any, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict{' or None' if optional else ''}, got {type(value).__name__}")


def _column_value(name: str, value: Any) -> Any:
    """A record field as it is stored: JSON text for dict/list fields, the string for the status."""
    if name in JOB_JSON:
        return to_json(name, value)
    if isinstance(value, JobStatus):
        return value.value
    return value


def require_job(conn: sqlite3.Connection, job_id: str, tenant: str | None = None) -> None:
    """Raise NotFoundError unless job `job_id` exists (and is `tenant`'s, when a tenant is given)."""
    if tenant is None:
        row = conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone()
    else:
        row = conn.execute("SELECT 1 FROM jobs WHERE id = ? AND tenant = ?", (job_id, tenant)).fetchone()
    if row is None:
        raise NotFoundError(f"no fine-tuning job {job_id!r}")


class JobTable:
    """Create, read, list and update fine-tuning jobs."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create(self, tenant: str, model: str, training_file: str, *, validation_file: str | None = None,
                   hyperparameters: dict[str, Any] | None = None, method: dict[str, Any] | None = None,
                   suffix: str | None = None, seed: int | None = None, metadata: dict[str, str] | None = None,
                   extensions: dict[str, Any] | None = None) -> JobRecord:
        """Record a new job of `tenant` in status `validating_files`.

        Args:
            model: the base (or fine-tuned) model to train from; the gateway has checked it exists.
            training_file, validation_file: ids of `tenant`'s own live files.
            seed: None picks one at random (it is returned in the record, as OpenAI does).
            extensions: settings OpenAI has no field for, e.g. `{"lora": {"r": 8, ...}}`.

        Raises:
            ValueError: a file is not one of `tenant`'s files, a bad suffix or seed, a non-dict argument.
        """
        check_tenant(tenant)
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        check_suffix(suffix)
        if seed is None:
            seed = secrets.randbelow(_MAX_SEED + 1)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= _MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, {_MAX_SEED}], got {seed!r}")
        for name, value in (("hyperparameters", hyperparameters), ("method", method), ("metadata", metadata),
                            ("extensions", extensions)):
            _check_dict(name, value)
        job = JobRecord(id=new_id("ftjob"), tenant=tenant, model=model, training_file=training_file,
                        created_at=self._db.now(), seed=seed, validation_file=validation_file,
                        hyperparameters=dict(hyperparameters or {}), method=method, suffix=suffix,
                        metadata=metadata, extensions=dict(extensions or {}))
        with self._db.write() as conn:
            # Checked inside the write transaction so the file cannot be deleted between check and insert.
            for param, file_id in (("training_file", training_file), ("validation_file", validation_file)):
                if file_id is None:
                    continue
                row = conn.execute("SELECT 1 FROM files WHERE id = ? AND tenant = ? AND deleted = 0",
                                   (file_id, tenant)).fetchone()
                if row is None:
                    raise ValueError(f"{param}: no such file {file_id!r}")
            conn.execute(_INSERT_JOB, tuple(_column_value(c, getattr(job, c)) for c in _JOB_COLUMNS))
        return job

    def get(self, tenant: str, job_id: str) -> JobRecord | None:
        """The job `job_id` of `tenant`; None when it does not exist or is another tenant's."""
        with self._db.read() as conn:
            row = conn.execute("SELECT * FROM jobs WHERE id = ? AND tenant = ?", (job_id, tenant)).fetchone()
        return None if row is None else from_row(JobRecord, row, JOB_JSON, _JOB_CONVERT)

    def owner(self, job_id: str) -> str | None:
        """The tenant of job `job_id`; None when there is no such job. Only for admin requests, which
        act on a job in its owner's name."""
        with self._db.read() as conn:
            row = conn.execute("SELECT tenant FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else str(row[0])

    def page(self, tenant: str | None, *, after: str | None = None,
                  limit: int = 20) -> tuple[list[JobRecord], bool]:
        """A page of `tenant`'s jobs (every tenant's for None: an admin's listing), newest first, and
        whether more follow.

        Raises:
            ValueError: bad limit, or `after` is not one of the listed job ids.
        """
        scope, params = ("1", ()) if tenant is None else ("tenant = ?", (tenant,))
        rows, has_more = self._db.page("jobs", scope, params, after=after, limit=limit)
        return [from_row(JobRecord, row, JOB_JSON, _JOB_CONVERT) for row in rows], has_more

    def active(self) -> list[JobRecord]:
        """Every tenant's jobs that are not finished, oldest first: what the scheduler picks up on start."""
        terminal = [s.value for s in JobStatus if s.is_terminal]
        with self._db.read() as conn:
            rows = conn.execute(f"SELECT * FROM jobs WHERE status NOT IN ({', '.join('?' for _ in terminal)}) "
                                "ORDER BY seq", terminal).fetchall()
        return [from_row(JobRecord, row, JOB_JSON, _JOB_CONVERT) for row in rows]

    def update(self, job_id: str, **fields: Any) -> JobRecord:
        """Change some of a job's mutable fields (`MUTABLE_JOB_FIELDS`) in one transaction; the new record.

        A change of `status` must be allowed by the state machine. Entering a terminal status sets
        `finished_at` (to now, unless given) and clears `estimated_finish`.

        Raises:
            NotFoundError: no job `job_id`.
            ValueError: an unknown or immutable field, a bad value, or an illegal status transition.
        """
        unknown = sorted(set(fields) - MUTABLE_JOB_FIELDS)
        if unknown:
            raise ValueError(f"a job update cannot change {unknown}; mutable fields: {sorted(MUTABLE_JOB_FIELDS)}")
        if "status" in fields:
            fields["status"] = JobStatus(fields["status"])  # ValueError names the bad value
        for name in ("error", "method"):
            if name in fields:
                _check_dict(name, fields[name])
        for name in ("hyperparameters", "extensions"):
            if name in fields:
                _check_dict(name, fields[name], optional=False)
        if "result_files" in fields and not isinstance(fields["result_files"], list):
            raise ValueError(f"result_files must be a list, got {type(fields['result_files']).__name__}")
        with self._db.write() as conn:
            row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no fine-tuning job {job_id!r}")
            job = from_row(JobRecord, row, JOB_JSON, _JOB_CONVERT)
            new_status = fields.get("status", job.status)
            check_transition(job.status, new_status)
            if new_status.is_terminal and not job.status.is_terminal:
                fields.setdefault("finished_at", self._db.now())
                fields.setdefault("estimated_finish", None)
            if fields:
                names = sorted(fields)
                conn.execute(f"UPDATE jobs SET {', '.join(f'{n} = ?' for n in names)} WHERE id = ?",
                             (*(_column_value(n, fields[n]) for n in names), job_id))
            # Read back rather than patch `job`: the caller's dicts must not alias the returned record's.
            row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return from_row(JobRecord, row, JOB_JSON, _JOB_CONVERT)
