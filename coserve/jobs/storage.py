"""The storage quotas on the scheduler's side of fine-tuning (`coserve.tenancy.storage_quota`).

Two checks, both measured from the store and the disk:

* when a job's training file is tokenized, its reservation of fine-tuned models is set from the
  resolved `n_epochs` ("auto" may differ from the gateway's estimate) and checked against the models and
  older jobs' reservations (a newer job was admitted counting this one's);
* when the engine has written a checkpoint or a final adapter, before it is registered as a model: over
  `max_stored_bytes` (or `max_fine_tuned_models`, for a job admitted under a higher limit), the folder is
  removed, nothing is registered, and the job fails with `storage_quota_exceeded` (or
  `model_quota_exceeded`) and an event saying what to delete.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from coserve.store import JobRecord, MetadataStore
from coserve.store.usage import RESERVED_MODELS_KEY, tree_bytes
from coserve.tenancy.quotas import Refusal, TenantLimits
from coserve.tenancy.storage_quota import admit_job, check_saved_adapter, has_storage_limits, models_per_job


class JobStorage:
    """The storage checks of one job manager.

    Args:
        store: the metadata store (usage is measured from it and from the disk).
        limits: tenant -> limits (a tenant not named has none).
    """

    def __init__(self, store: MetadataStore, limits: Mapping[str, TenantLimits]) -> None:
        self._store, self._limits = store, limits

    def _of(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, TenantLimits())

    def reserve(self, record: JobRecord, n_epochs: int) -> Refusal | None:
        """Set the job's reservation to the models `n_epochs` will write, or say why they do not fit
        (the reservation is then left as it was; the caller fails the job)."""
        reserved = models_per_job(n_epochs)
        limits = self._of(record.tenant)
        refusal = None
        if has_storage_limits(limits):
            refusal = admit_job(limits, self._store.usage.of(record.tenant, before_job=record.id), reserved)
        if refusal is None and record.extensions.get(RESERVED_MODELS_KEY) != reserved:
            extensions = {**record.extensions, RESERVED_MODELS_KEY: reserved}
            self._store.jobs.update(record.id, extensions=extensions)
            record.extensions = extensions
        return refusal

    def admit_saved(self, tenant: str, path: str | None) -> Refusal | None:
        """Whether the adapter just written at `path` may be kept; when not, it is removed from disk."""
        limits = self._of(tenant)
        if not has_storage_limits(limits):
            return None
        saved = tree_bytes(Path(path)) if path else 0
        refusal = check_saved_adapter(limits, self._store.usage.of(tenant), saved)
        if refusal is not None:
            self._store.usage.remove_adapter(path)
        return refusal
