"""The metadata store: files, jobs, events, checkpoints, models and stored responses in one SQLite file.
Imported by: jobs, api, actors, server."""

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
