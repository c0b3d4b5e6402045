"""Storage quotas: the tenants file keys, and what fits under `max_stored_bytes` and `max_fine_tuned_models`."""

from __future__ import annotations

import pytest

from coserve.contract.storage_usage import StorageUsage
from coserve.tenancy.quotas import DEFAULT_LIMITS, TenantLimits
from coserve.tenancy.storage_quota import (
    QUOTA_CODES,
    admit_job,
    admit_upload,
    check_saved_adapter,
    models_per_job,
)
from coserve.tenancy.tenants import parse_tenants


def test_tenants_file_keys_parse_and_default_to_the_finite_defaults() -> None:
    config = parse_tenants({"tenants": {
        "acme": {"api_keys": ["k1"], "limits": {"max_stored_bytes": 1_000_000, "max_fine_tuned_models": 0}},
        "globex": {"api_keys": ["k2"]}}})
    assert config.tenants["acme"].limits.max_stored_bytes == 1_000_000
    assert config.tenants["acme"].limits.max_fine_tuned_models == 0
    assert config.tenants["globex"].limits == DEFAULT_LIMITS
    assert TenantLimits().max_stored_bytes is None and TenantLimits().max_fine_tuned_models is None


@pytest.mark.parametrize("limits", [{"max_stored_bytes": -1}, {"max_stored_bytes": 1.5},
                                    {"max_fine_tuned_models": True}, {"max_fine_tuned_models": "3"}])
def test_bad_values_are_refused_naming_the_key(limits: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(limits))):
        parse_tenants({"tenants": {"acme": {"api_keys": ["k"], "limits": limits}}})


def test_upload_fits_up_to_the_byte() -> None:
    limits = TenantLimits(max_stored_bytes=1000)
    usage = StorageUsage(file_bytes=600, adapter_bytes=300)
    assert admit_upload(limits, usage, 100) is None
    refusal = admit_upload(limits, usage, 101)
    assert refusal is not None and refusal.retry_after_s is None and refusal.limit == "max_stored_bytes"
    assert "1001" in refusal.reason and "max_stored_bytes=1000" in refusal.reason
    assert admit_upload(TenantLimits(), usage, 10**12) is None


def test_job_reserves_a_checkpoint_per_epoch_and_the_final_model() -> None:
    assert models_per_job(1) == 2 and models_per_job(3) == 4
    with pytest.raises(ValueError):
        models_per_job(0)
    limits = TenantLimits(max_fine_tuned_models=5)
    assert admit_job(limits, StorageUsage(fine_tuned_models=1, reserved_models=2), 2) is None
    refusal = admit_job(limits, StorageUsage(fine_tuned_models=1, reserved_models=2), 3)
    assert refusal is not None and refusal.limit == "max_fine_tuned_models" and refusal.retry_after_s is None
    assert admit_job(TenantLimits(max_fine_tuned_models=0), StorageUsage(), 2) is not None


def test_job_needs_a_byte_of_room() -> None:
    limits = TenantLimits(max_stored_bytes=100)
    assert admit_job(limits, StorageUsage(file_bytes=99), 2) is None
    refusal = admit_job(limits, StorageUsage(file_bytes=60, adapter_bytes=40), 2)
    assert refusal is not None and QUOTA_CODES[refusal.limit] == "storage_quota_exceeded"


def test_saved_adapter_is_kept_only_within_both_limits() -> None:
    limits = TenantLimits(max_stored_bytes=100, max_fine_tuned_models=2)
    assert check_saved_adapter(limits, StorageUsage(adapter_bytes=100, fine_tuned_models=1), 50) is None
    over_bytes = check_saved_adapter(limits, StorageUsage(adapter_bytes=101), 50)
    assert over_bytes is not None and over_bytes.limit == "max_stored_bytes"
    over_models = check_saved_adapter(limits, StorageUsage(fine_tuned_models=2), 50)
    assert over_models is not None and QUOTA_CODES[over_models.limit] == "model_quota_exceeded"
