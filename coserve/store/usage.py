"""What each tenant stores, measured from the metadata store and the disk (never kept in memory, so it is
right after a restart), and the removal of a deleted model's adapter folder.

A tenant's stored bytes are its live uploads (their sizes are in the `files` table) plus everything under
`<data_dir>/adapters/<job_id>/` of each of its jobs (checkpoints, the final model, a half-written folder
left by a crash) and under `<data_dir>/runs/<run>/` of each of its Tinker training runs (their saves;
the run's `run.json` names its tenant): what its fine-tuning really takes on disk. Its fine-tuned
models are its live `models` rows, checkpoints included; a job reserves the models it will write in
`extensions["reserved_models"]`, and what it has not written yet counts while the job is active.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from coserve.contract.storage_usage import StorageUsage
from coserve.store._base import Database
from coserve.store.records import JobStatus, is_generated_id

logger = logging.getLogger(__name__)

ADAPTERS_DIR = "adapters"
RUNS_DIR = "runs"  # the Tinker API's training runs (`coserve.cluster.training_runs`)
RESERVED_MODELS_KEY = "reserved_models"
"""The key of a job's `extensions` that holds how many fine-tuned models it reserved at creation."""

_ACTIVE = tuple(s.value for s in JobStatus if not s.is_terminal)


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (0 when it does not exist); links are not followed."""
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                info = os.lstat(os.path.join(root, name))
            except FileNotFoundError:  # removed meanwhile (a checkpoint being replaced)
                continue
            total += info.st_size
    return total


class UsageTable:
    """Measure a tenant's storage and remove adapter folders."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self.adapters_root = db.data_dir.resolve() / ADAPTERS_DIR
        self.runs_root = db.data_dir.resolve() / RUNS_DIR

    def job_dir(self, job_id: str) -> Path:
        """`<data_dir>/adapters/<job_id>` (ValueError unless `job_id` is a generated job id)."""
        if not (is_generated_id(job_id) and job_id.startswith("ftjob-")):
            raise ValueError(f"not a job id: {job_id!r}")
        return self.adapters_root / job_id

    def adapter_bytes(self, tenant: str) -> int:
        """Bytes of every adapter folder of `tenant`'s jobs on disk."""
        with self._db.read() as conn:
            job_ids = [row[0] for row in conn.execute("SELECT id FROM jobs WHERE tenant = ?", (tenant,))]
        return sum(tree_bytes(self.job_dir(job_id)) for job_id in job_ids) + self._run_bytes(tenant)

    def _run_bytes(self, tenant: str) -> int:
        """Bytes of the folders of `tenant`'s training runs (each `run.json` names its tenant)."""
        total = 0
        for run in self.runs_root.iterdir() if self.runs_root.is_dir() else ():
            try:
                owner = json.loads((run / "run.json").read_text()).get("tenant")
            except (OSError, ValueError):
                continue
            if owner == tenant:
                total += tree_bytes(run)
        return total

    def of(self, tenant: str, *, before_job: str | None = None) -> StorageUsage:
        """What `tenant` stores now.

        Args:
            before_job: count only the reservations of active jobs created before this one (a job
                being validated is checked against older jobs only: a newer one was admitted counting
                this job's reservation already); None counts every active job's.
        """
        with self._db.read() as conn:
            file_bytes = conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ? AND deleted = 0",
                                      (tenant,)).fetchone()[0]
            models = conn.execute("SELECT COUNT(*) FROM models WHERE tenant = ? AND deleted = 0",
                                  (tenant,)).fetchone()[0]
            placeholders = ", ".join("?" for _ in _ACTIVE)
            jobs = conn.execute(
                f"SELECT j.id, j.seq, j.extensions, (SELECT COUNT(*) FROM models m WHERE m.job_id = j.id) "
                f"FROM jobs j WHERE j.tenant = ? AND j.status IN ({placeholders})", (tenant, *_ACTIVE)).fetchall()
            cutoff = None
            if before_job is not None:
                row = conn.execute("SELECT seq FROM jobs WHERE id = ?", (before_job,)).fetchone()
                cutoff = None if row is None else row[0]
        reserved = 0
        for job_id, seq, extensions, produced in jobs:
            if job_id == before_job or (cutoff is not None and seq > cutoff):
                continue
            wanted = json.loads(extensions).get(RESERVED_MODELS_KEY, 0)
            reserved += max(0, int(wanted) - produced)
        return StorageUsage(file_bytes=int(file_bytes), adapter_bytes=self.adapter_bytes(tenant),
                            fine_tuned_models=int(models), reserved_models=reserved)

    def remove_adapter(self, adapter_path: str | None) -> bool:
        """Remove an adapter folder under `<data_dir>/adapters/` (and its job's folder once empty).

        A path outside that folder is left alone (it was not written by a job of this store). Returns
        whether a folder was removed.
        """
        if not adapter_path:
            return False
        path = Path(adapter_path).resolve()
        if path.is_relative_to(self.runs_root) and path.parent.parent.parent == self.runs_root:
            shutil.rmtree(path, ignore_errors=True)  # a Tinker run's sampler weights (`runs/<run>/<kind>/<name>`)
            return True
        if not path.is_relative_to(self.adapters_root) or path.parent.parent != self.adapters_root:
            logger.warning("not removing adapter folder %s: outside %s", path, self.adapters_root)
            return False
        if not path.exists():
            return False
        shutil.rmtree(path)
        try:
            path.parent.rmdir()  # the job's folder, once its last adapter is gone
        except OSError:
            pass  # other adapters of the job remain (or it is already gone)
        return True

    def sweep_deleted(self) -> list[str]:
        """Remove the folders of deleted models still on disk (a crash between a delete's row and its
        folder); returns the folders removed."""
        with self._db.read() as conn:
            paths = [row[0] for row in conn.execute(
                "SELECT adapter_path FROM models WHERE deleted = 1 AND adapter_path IS NOT NULL")]
        return [path for path in paths if self.remove_adapter(path)]
