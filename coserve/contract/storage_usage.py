"""What one tenant stores now, as the metadata store measures it (`coserve.store.usage`) and the storage
quotas read it (`coserve.tenancy.storage_quota`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StorageUsage:
    """What one tenant stores now.

    Args:
        file_bytes: bytes of its live uploaded files.
        adapter_bytes: bytes of its jobs' adapter folders on disk (checkpoints, final models).
        fine_tuned_models: its live fine-tuned models, checkpoints included.
        reserved_models: models its active jobs are still to write (reserved at creation).
    """

    file_bytes: int = 0
    adapter_bytes: int = 0
    fine_tuned_models: int = 0
    reserved_models: int = 0

    @property
    def stored_bytes(self) -> int:
        """Everything counted against `max_stored_bytes`."""
        return self.file_bytes + self.adapter_bytes
