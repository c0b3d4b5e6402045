"""Why a fine-tuning job failed, as the `error` it reports (OpenAI's `code`, `message`, `param`).

A job's failure is the job's: whatever its preparation, start, control or events raise ends that job with
an error saying so, never the job manager's pass (the other tenants' jobs go on). `failure` says what the
job reports for an exception, by its type, never by its message text:

* `JobRefused` carries its code and param (a quota, a deleted starting model, a bad row read back);
* a `ValueError` while preparing is the job's own input: its kind names the file (`invalid_training_file`,
  `invalid_validation_file`, `invalid_n_examples`) or the grader, and its message is shown;
* a checkpoint that cannot be read to resume from is `checkpoint_unreadable`;
* anything else is the server's (a bug, a disk error): `internal_error` with the stage and the
  exception's type, not its text (which may hold the server's paths); the log has the traceback.

Messages are cut to `MAX_ERROR_CHARS` and made storable (a lone surrogate from a row is escaped).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from coserve.contract.training_settings import SettingsError, TooFewExamplesError
from coserve.jobs.prepared_job import ValidationFileError
from coserve.store import MetadataStore
from coserve.store.records import JobStatus

INTERNAL_ERROR = "internal_error"
MAX_ERROR_CHARS = 2000


class JobStage(enum.Enum):
    """What the job manager was doing for a job when it failed (said in an internal error's message)."""

    PREPARING = "validating its files"
    RESUMING = "reading its last checkpoint to resume from"
    STARTING = "starting"
    CONTROLLING = "applying a pause, resume or cancel"
    RECORDING = "recording its progress"


class JobRefused(ValueError):
    """A job that cannot start for a reason other than its training file's content, with the
    `error.code` and `error.param` it fails with (e.g. over the tenant's `max_training_tokens_per_job`:
    `quota_exceeded`; its starting model deleted meanwhile: `model_not_available`, param `model`)."""

    def __init__(self, message: str, code: str, param: str | None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True, slots=True)
class JobError:
    """A failed job's `error` object."""

    code: str
    message: str
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param}


def storable(text: str) -> str:
    """`text` cut to `MAX_ERROR_CHARS`, any lone surrogate escaped (SQLite and JSON take only valid text)."""
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def failure(err: Exception, stage: JobStage) -> JobError:
    """The error a job reports when `stage` raised `err` (module docstring)."""
    if stage is JobStage.RESUMING:  # the checkpoint the server wrote, not the tenant's input
        return JobError("checkpoint_unreadable", f"its last checkpoint could not be read to resume from "
                        f"({type(err).__name__}); the server's log has the details")
    if isinstance(err, JobRefused):
        return JobError(err.code, storable(str(err)), err.param)
    if stage is not JobStage.PREPARING or not isinstance(err, ValueError):
        return JobError(INTERNAL_ERROR, f"an internal error ({type(err).__name__}) stopped the job while "
                        f"{stage.value}; the server's log has the details")
    message = storable(str(err))
    if isinstance(err, ValidationFileError):
        return JobError("invalid_validation_file", message, "validation_file")
    if isinstance(err, TooFewExamplesError):
        return JobError("invalid_n_examples", message, "training_file")
    if isinstance(err, SettingsError) and err.param.startswith("method.reinforcement.grader"):
        return JobError("invalid_grader", message, err.param)
    return JobError("invalid_training_file", message, "training_file")


def update_terminal(store: MetadataStore, job_id: str, **fields: Any) -> None:
    """A final status, unless the job is already final (e.g. cancelled by its tenant meanwhile)."""
    try:
        store.jobs.update(job_id, **fields)
    except ValueError:
        pass  # an illegal transition out of a terminal status: the first final word stands


def record_failure(store: MetadataStore, job_id: str, error: JobError) -> None:
    """The job's failure in the store: an error event and `failed` with `error` (unless already final)."""
    tenant = store.jobs.owner(job_id)
    current = None if tenant is None else store.jobs.get(tenant, job_id)
    if current is None or current.status.is_terminal:
        return  # cancelled (or ended, or deleted) meanwhile: its first final word stands, no failure event
    store.events.add(job_id, f"Job failed: {error.message}", level="error")
    update_terminal(store, job_id, status=JobStatus.FAILED, error=error.as_dict())
