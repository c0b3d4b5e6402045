"""The metadata store: files, fine-tuning jobs, events, checkpoints and models in one SQLite file."""

from coserve.actors.store.records import (ALLOWED_TRANSITIONS, CheckpointRecord, EventRecord, FileRecord,
                                          JobRecord, JobStatus, ModelRecord, NotFoundError,
                                          StorageLimitError)
from coserve.actors.store.store import MetadataStore

__all__ = ["ALLOWED_TRANSITIONS", "CheckpointRecord", "EventRecord", "FileRecord", "JobRecord", "JobStatus",
           "MetadataStore", "ModelRecord", "NotFoundError", "StorageLimitError"]
