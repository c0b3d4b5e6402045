"""Records of the metadata store: plain dataclasses that cross process (Ray) boundaries.

Every field is an int, float, str, bool, None, list or JSON-able dict, so a record pickles cheaply
and the gateway can turn it into an OpenAI object field by field.
"""

from __future__ import annotations

import enum
import re
import secrets
from dataclasses import dataclass, field
from typing import Any


class JobStatus(str, enum.Enum):
    """Life cycle of a fine-tuning job; the values are OpenAI's status strings (plus `paused`)."""

    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """True for the states a job never leaves (succeeded, failed, cancelled)."""
        return self in _TERMINAL


_TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})

# running -> queued is how a job that was running when the server died is put back in line on restart
# (it resumes from its last checkpoint); paused -> queued is `resume`.
ALLOWED_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.VALIDATING_FILES: frozenset({JobStatus.QUEUED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.PAUSED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset({JobStatus.QUEUED, JobStatus.PAUSED, JobStatus.SUCCEEDED, JobStatus.FAILED,
                                  JobStatus.CANCELLED}),
    # Succeeded too: a pause that lands after the last step cannot undo it (the model is registered).
    JobStatus.PAUSED: frozenset({JobStatus.QUEUED, JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


def check_transition(current: JobStatus, new: JobStatus) -> None:
    """Raise ValueError unless a job may go from `current` to `new` (staying put is always allowed)."""
    if new != current and new not in ALLOWED_TRANSITIONS[current]:
        raise ValueError(f"illegal job status transition {current.value} -> {new.value}")


FILE_PURPOSES = frozenset({"assistants", "assistants_output", "batch", "batch_output", "fine-tune",
                           "fine-tune-results", "vision", "user_data", "evals"})
EVENT_LEVELS = frozenset({"info", "warn", "error"})
EVENT_TYPES = frozenset({"message", "metrics"})

# Suffixes become part of model ids (`ft:{base}:{tenant}:{suffix}:{id}`) and of adapter folder names, so
# `:`, `/` and `.` are refused (ref. D1).
_SUFFIX_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Generated ids only: what a caller passes as an id is matched against this before it names a file.
_ID_RE = re.compile(r"(file|ftjob|ftevent|ftckpt)-[0-9a-f]{24}")


def new_id(prefix: str) -> str:
    """A fresh id `<prefix>-<24 hex>` (96 random bits)."""
    return f"{prefix}-{secrets.token_hex(12)}"


def is_generated_id(value: str) -> bool:
    """True when `value` has the exact shape of an id this store generates (safe as a file name)."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def check_suffix(suffix: str | None) -> None:
    """Raise ValueError unless `suffix` is None or 1-64 characters of [A-Za-z0-9_-]."""
    if suffix is not None and (not isinstance(suffix, str) or _SUFFIX_RE.fullmatch(suffix) is None):
        raise ValueError(f"suffix must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-', got {suffix!r}")


def check_choice(name: str, value: str, allowed: frozenset[str]) -> None:
    """Raise ValueError naming `name` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")


class NotFoundError(LookupError):
    """An id the caller names does not exist (or belongs to another tenant): the gateway answers 404."""


class StorageLimitError(Exception):
    """A write would take a tenant's live files past the byte budget it was given (another upload of the
    same tenant took the room first); nothing was stored."""


@dataclass(slots=True)
class FileRecord:
    """An uploaded file (OpenAI `FileObject` without `object`); the bytes live in `<data>/files/<id>`."""

    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"


@dataclass(slots=True)
class JobRecord:
    """A fine-tuning job (OpenAI `FineTuningJob` without `object`/`organization_id`).

    `extensions` holds what OpenAI has no field for (e.g. the LoRA config `{"lora": {"r": 8, ...}}`).
    """

    id: str
    tenant: str
    model: str
    training_file: str
    created_at: int
    seed: int
    status: JobStatus = JobStatus.VALIDATING_FILES
    validation_file: str | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    method: dict[str, Any] | None = None
    suffix: str | None = None
    metadata: dict[str, str] | None = None
    fine_tuned_model: str | None = None
    trained_tokens: int | None = None
    error: dict[str, Any] | None = None
    finished_at: int | None = None
    estimated_finish: int | None = None
    result_files: list[str] = field(default_factory=list)
    extensions: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class EventRecord:
    """One event of a job (OpenAI `FineTuningJobEvent`); `data` carries metrics for `type == "metrics"`."""

    id: str
    job_id: str
    created_at: int
    level: str
    message: str
    type: str = "message"
    data: dict[str, Any] | None = None


@dataclass(slots=True)
class CheckpointRecord:
    """A saved adapter of a job at one step (OpenAI `FineTuningJobCheckpoint`) and where it lies on disk."""

    id: str
    job_id: str
    step_number: int
    fine_tuned_model_checkpoint: str
    metrics: dict[str, Any]
    created_at: int
    adapter_path: str | None = None


@dataclass(slots=True)
class ModelRecord:
    """A servable model: a base model (`tenant is None`, visible to all) or a tenant's fine-tuned adapter."""

    id: str
    tenant: str | None
    base_model: str | None
    created_at: int
    adapter_path: str | None = None
    job_id: str | None = None
    deleted: bool = False
