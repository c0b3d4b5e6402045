"""The metadata store: files, fine-tuning jobs, events, checkpoints and models in one SQLite file."""

from coserve.store.records import (
                                          ALLOWED_TRANSITIONS,
                                          CheckpointRecord,
                                          EventRecord,
                                          FileRecord,
                                          JobRecord,
                                          JobStatus,
                                          ModelRecord,
                                          NotFoundError,
                                          StorageLimitError,
)
from coserve.store.store import MetadataStore

__all__ = ["ALLOWED_TRANSITIONS", "CheckpointRecord", "EventRecord", "FileRecord", "JobRecord", "JobStatus",
           "MetadataStore", "ModelRecord", "NotFoundError", "StorageLimitError"]
