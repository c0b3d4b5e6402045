"""Token buckets and tenant quotas, with an explicit clock."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.tenancy.quotas import JOB_RETRY_AFTER_S, Refusal, TenantLimits, TenantQuota, TokenBucket


def test_bucket_starts_full_and_refuses_with_exact_retry_after() -> None:
    bucket = TokenBucket(capacity=10, refill_per_s=2)
    assert bucket.try_take(10, now=100.0) is None
    refusal = bucket.try_take(4, now=101.0)  # 2 tokens back after 1 s, 2 missing at 2/s
    assert refusal is not None and refusal.retry_after_s == pytest.approx(1.0)
    assert bucket.available(now=101.0) == pytest.approx(2.0)  # a refusal takes nothing
    assert bucket.try_take(4, now=102.0) is None  # exactly when the refusal said


def test_bucket_never_exceeds_capacity_and_ignores_a_clock_stepping_back() -> None:
    bucket = TokenBucket(capacity=5, refill_per_s=1, limit="tokens_per_minute")
    bucket.try_take(5, now=0.0)
    assert bucket.available(now=1000.0) == 5.0
    bucket.try_take(5, now=1000.0)
    assert bucket.available(now=990.0) == 0.0  # no refill from a backwards step
    assert bucket.available(now=1001.0) == pytest.approx(1.0)  # nor a double refill afterwards


def test_amount_over_capacity_never_fits() -> None:
    bucket = TokenBucket.per_minute(100, "tokens_per_minute")
    refusal = bucket.try_take(101, now=0.0)
    assert refusal == Refusal("tokens_per_minute", refusal.reason, None)
    assert "tokens_per_minute=100" in refusal.reason


def test_refund_is_capped_at_capacity() -> None:
    bucket = TokenBucket(capacity=10, refill_per_s=1)
    bucket.try_take(8, now=0.0)
    bucket.refund(3, now=0.0)
    assert bucket.available(now=0.0) == 5.0
    bucket.refund(100, now=0.0)
    assert bucket.available(now=0.0) == 10.0


@settings(max_examples=50, deadline=None)
@given(capacity=st.integers(1, 1000), per_minute=st.integers(1, 6000),
       calls=st.lists(st.tuples(st.floats(0, 30, allow_nan=False), st.integers(0, 1200)),
                      min_size=1, max_size=40))
def test_bucket_never_grants_more_than_capacity_plus_refill(capacity: int, per_minute: int,
                                                            calls: list[tuple[float, int]]) -> None:
    rate = per_minute / 60.0
    bucket = TokenBucket(capacity, rate)
    now, granted = 0.0, 0
    for step, amount in calls:
        now += step
        refusal = bucket.try_take(amount, now)
        if refusal is None:
            granted += amount
        elif refusal.retry_after_s is not None:
            # Waiting the advertised time is enough (with no other taker), and needed.
            probe = copy.deepcopy(bucket)
            if refusal.retry_after_s > 1e-3:  # below that, float rounding of `now` decides
                early = copy.deepcopy(bucket)
                assert early.try_take(amount, now + refusal.retry_after_s * (1 - 1e-6)) is not None
            assert probe.try_take(amount, now + refusal.retry_after_s * (1 + 1e-9)) is None
        else:
            assert amount > capacity
        assert granted <= capacity + rate * now + 1e-6


def test_admit_request_is_atomic_across_buckets() -> None:
    quota = TenantQuota(TenantLimits(requests_per_minute=60, tokens_per_minute=100))
    assert quota.admit_request(90, now=0.0) is None
    refusal = quota.admit_request(50, now=0.0)  # rpm has room, tpm does not
    assert refusal is not None and refusal.limit == "tokens_per_minute"
    # The refused request took no request slot: 59 more zero-token requests fit, then rpm refuses.
    assert all(quota.admit_request(0, now=0.0) is None for _ in range(59))
    refusal = quota.admit_request(0, now=0.0)
    assert refusal is not None and refusal.limit == "requests_per_minute"
    assert refusal.retry_after_s == pytest.approx(1.0)


def test_admit_request_reports_the_longer_wait_or_never() -> None:
    quota = TenantQuota(TenantLimits(requests_per_minute=1, tokens_per_minute=600))
    assert quota.admit_request(600, now=0.0) is None
    refusal = quota.admit_request(300, now=0.0)  # rpm: 60 s, tpm: 30 s
    assert refusal is not None and refusal.limit == "requests_per_minute"
    assert refusal.retry_after_s == pytest.approx(60.0)
    never = quota.admit_request(601, now=0.0)
    assert never is not None and never.limit == "tokens_per_minute" and never.retry_after_s is None


def test_a_later_prompt_takes_tokens_but_no_request() -> None:
    quota = TenantQuota(TenantLimits(requests_per_minute=1, tokens_per_minute=100))
    assert quota.admit_request(30, now=0.0) is None
    assert quota.admit_request(30, now=0.0, requests=0) is None  # the same completions request
    assert quota.admit_request(50, now=0.0, requests=0).limit == "tokens_per_minute"
    assert quota.admit_request(0, now=0.0).limit == "requests_per_minute"


def test_refund_returns_unused_tokens() -> None:
    quota = TenantQuota(TenantLimits(tokens_per_minute=100))
    assert quota.admit_request(100, now=0.0) is None
    assert quota.admit_request(40, now=0.0) is not None
    quota.refund(40, now=0.0)  # the first request used 60 of its 100
    assert quota.admit_request(40, now=0.0) is None


def test_unlimited_tenant_is_always_admitted() -> None:
    quota = TenantQuota(TenantLimits())
    assert all(quota.admit_request(10**9, now=0.0) is None for _ in range(100))
    assert quota.admit_job(active_jobs=1000, training_tokens=10**12) is None
    quota.refund(5, now=0.0)  # no bucket: nothing to do, and no error


def test_too_large_job_never_fits_and_is_checked_before_concurrency() -> None:
    quota = TenantQuota(TenantLimits(max_concurrent_jobs=2, max_training_tokens_per_job=1000))
    refusal = quota.admit_job(active_jobs=2, training_tokens=1001)
    assert refusal is not None and refusal.limit == "max_training_tokens_per_job"
    assert refusal.retry_after_s is None and "1001" in refusal.reason


def test_concurrency_refusal_is_retryable() -> None:
    quota = TenantQuota(TenantLimits(max_concurrent_jobs=2, max_training_tokens_per_job=1000))
    assert quota.admit_job(active_jobs=1, training_tokens=1000) is None
    refusal = quota.admit_job(active_jobs=2, training_tokens=10)
    assert refusal is not None and refusal.limit == "max_concurrent_jobs"
    assert refusal.retry_after_s == JOB_RETRY_AFTER_S
    assert quota.admit_job(2, 10, retry_after_s=5.0).retry_after_s == 5.0


def test_zero_concurrent_jobs_disables_fine_tuning() -> None:
    refusal = TenantQuota(TenantLimits(max_concurrent_jobs=0)).admit_job(0, 1)
    assert refusal is not None and refusal.retry_after_s is None and "disabled" in refusal.reason


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", ["requests_per_minute", "tokens_per_minute",
                                  "max_training_tokens_per_job"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "10"])
def test_bad_limit_names_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be an integer >= 1"):
        TenantLimits(**{name: value})


def test_negative_concurrent_jobs_rejected() -> None:
    with pytest.raises(ValueError, match="^max_concurrent_jobs must be an integer >= 0"):
        TenantLimits(max_concurrent_jobs=-1)


@pytest.mark.parametrize("kwargs", [{"capacity": 0, "refill_per_s": 1},
                                    {"capacity": 1, "refill_per_s": -1},
                                    {"capacity": math.inf, "refill_per_s": 1}])
def test_bad_bucket_settings_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="capacity|refill_per_s"):
        TokenBucket(**kwargs)


def test_negative_amounts_rejected() -> None:
    quota = TenantQuota(TenantLimits(tokens_per_minute=10, max_concurrent_jobs=1))
    with pytest.raises(ValueError, match="est_tokens"):
        quota.admit_request(-1, now=0.0)
    with pytest.raises(ValueError, match="tokens"):
        quota.refund(-1, now=0.0)
    with pytest.raises(ValueError, match="active_jobs"):
        quota.admit_job(-1, 10)
    with pytest.raises(ValueError, match="retry_after_s"):
        Refusal("x", "y", 0.0)
