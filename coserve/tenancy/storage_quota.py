"""Per-tenant storage quotas: bytes stored (`max_stored_bytes`) and fine-tuned models held
(`max_fine_tuned_models`, checkpoints included).

Pure: the caller measures what the tenant stores (`contract.storage_usage.StorageUsage`, from the metadata
store and the disk, so it survives restarts) and asks here whether one more upload, job or saved adapter fits. A storage
limit only clears when the tenant deletes something, so every refusal has `retry_after_s=None`: the API
answers 403 (`insufficient_quota`), which clients do not retry.

Fine-tuned models are **reserved when a job is created**: a job writes one checkpoint per epoch and its
final model (`models_per_job`), and all of them are counted against `max_fine_tuned_models` before it
starts, so a job admitted under the limit never has to stop for it. Bytes cannot be reserved that way
(an adapter's size is known once written, and uploads go on meanwhile), so a job is refused at creation
when the tenant has no byte left, and a checkpoint that brings the tenant over `max_stored_bytes` is
removed and fails its job with `storage_quota_exceeded` (`check_saved_adapter`).
"""

from __future__ import annotations

from coserve.contract.storage_usage import StorageUsage
from coserve.tenancy.quotas import Refusal, TenantLimits

# The `error.code` of each storage limit's refusals (at the API and on a failed job).
QUOTA_CODES = {"max_stored_bytes": "storage_quota_exceeded",
               "max_fine_tuned_models": "model_quota_exceeded"}


def has_storage_limits(limits: TenantLimits) -> bool:
    """Whether any storage limit applies (when none does, usage need not be measured)."""
    return limits.max_stored_bytes is not None or limits.max_fine_tuned_models is not None


def models_per_job(n_epochs: int) -> int:
    """The fine-tuned models a job of `n_epochs` writes: a checkpoint at each epoch's end, then its final
    model."""
    if isinstance(n_epochs, bool) or not isinstance(n_epochs, int) or n_epochs < 1:
        raise ValueError(f"n_epochs must be an integer >= 1, got {n_epochs!r}")
    return n_epochs + 1


def _free_hint(what: str) -> str:
    return f"delete {what} to free space, or ask the operator to raise the limit"


def admit_upload(limits: TenantLimits, usage: StorageUsage, new_bytes: int) -> Refusal | None:
    """Whether a file of `new_bytes` fits under the tenant's `max_stored_bytes`."""
    cap = limits.max_stored_bytes
    if cap is None or usage.stored_bytes + new_bytes <= cap:
        return None
    return Refusal("max_stored_bytes",
                   f"storing this file ({new_bytes} bytes) would bring your stored bytes to "
                   f"{usage.stored_bytes + new_bytes}, over max_stored_bytes={cap} (files: "
                   f"{usage.file_bytes} bytes, fine-tuned models: {usage.adapter_bytes} bytes); "
                   f"{_free_hint('files or fine-tuned models')}", None)


def admit_job(limits: TenantLimits, usage: StorageUsage, new_models: int) -> Refusal | None:
    """Whether a job that will write `new_models` models may be created: they fit under
    `max_fine_tuned_models` beside the tenant's models and other jobs' reservations, and the tenant has
    room for at least one byte of adapter under `max_stored_bytes`."""
    cap = limits.max_fine_tuned_models
    held = usage.fine_tuned_models + usage.reserved_models
    if cap is not None and held + new_models > cap:
        return Refusal("max_fine_tuned_models",
                       f"the job would write {new_models} fine-tuned models (a checkpoint per epoch and "
                       f"the final model); you hold {usage.fine_tuned_models} and your active jobs have "
                       f"reserved {usage.reserved_models}, and max_fine_tuned_models={cap}; "
                       f"{_free_hint('fine-tuned models')}, or train fewer epochs", None)
    byte_cap = limits.max_stored_bytes
    if byte_cap is not None and usage.stored_bytes >= byte_cap:
        return Refusal("max_stored_bytes",
                       f"you store {usage.stored_bytes} bytes, max_stored_bytes={byte_cap}: no room for "
                       f"the job's adapters; {_free_hint('files or fine-tuned models')}", None)
    return None


def check_saved_adapter(limits: TenantLimits, usage: StorageUsage, saved_bytes: int) -> Refusal | None:
    """Whether an adapter a job just wrote (`saved_bytes`, already counted in `usage.adapter_bytes`) may
    be kept and registered as one more fine-tuned model."""
    byte_cap = limits.max_stored_bytes
    if byte_cap is not None and usage.stored_bytes > byte_cap:
        return Refusal("max_stored_bytes",
                       f"the adapter ({saved_bytes} bytes) would bring your stored bytes to "
                       f"{usage.stored_bytes}, over max_stored_bytes={byte_cap}", None)
    cap = limits.max_fine_tuned_models
    if cap is not None and usage.fine_tuned_models + 1 > cap:
        return Refusal("max_fine_tuned_models",
                       f"you hold {usage.fine_tuned_models} fine-tuned models, max_fine_tuned_models="
                       f"{cap}", None)
    return None
