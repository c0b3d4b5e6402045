"""Per-tenant quotas: request and token rate limits (token buckets), concurrent jobs, job size, and the
limits on what a tenant stores (checked in `storage_quota`).

Pure: the clock is an argument (`now`, seconds on any monotonic scale), never read here, so tests and
the scheduler decide what time it is.

A refusal is a `Refusal`. Its `retry_after_s` says whether waiting helps, which is what the API layer
needs to pick a status code (OpenAI's conventions):

- a number (> 0): the limit is temporary; the same call succeeds after that many seconds at the latest
  if nothing else is taken meanwhile. Answer 429 with a `Retry-After` header (the official client
  honours it).
- None: the call can never succeed as sent (a request estimated at more tokens than the bucket holds,
  a job larger than `max_training_tokens_per_job`, fine-tuning disabled). Retrying is useless, so the
  API should answer 400 (`invalid_request_error`). OpenAI itself answers 429 for "request too large
  for tokens per minute"; we prefer the code that tells the client not to retry.

Concurrent fine-tuning jobs are a temporary limit, but when a running job ends is unknown here, so the
refusal carries a fixed hint (`JOB_RETRY_AFTER_S`, overridable per call) and the API answers 429.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_MINUTE = 60.0
# Hint for a refused job under `max_concurrent_jobs`: fine-tuning jobs run for minutes, so polling
# more often than this only adds load.
JOB_RETRY_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a call was refused and whether to retry.

    Args:
        limit: the `TenantLimits` field that refused (for error messages and codes).
        reason: a sentence for the client.
        retry_after_s: seconds until the call can succeed (> 0), or None when it never can.
    """

    limit: str
    reason: str
    retry_after_s: float | None

    def __post_init__(self) -> None:
        if self.retry_after_s is not None and not self.retry_after_s > 0:
            raise ValueError(f"retry_after_s must be > 0 or None, got {self.retry_after_s!r}")


def _check_amount(name: str, value: float) -> None:
    if isinstance(value, bool) or not value >= 0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class TokenBucket:
    """A bucket of `capacity` tokens refilled continuously at `refill_per_s`; it starts full.

    Args:
        capacity: the most that can be taken at once (the burst).
        refill_per_s: tokens added per second.
        limit: the name of the setting it enforces, used in refusals.

    Raises:
        ValueError: capacity or refill rate is not a finite number > 0.
    """

    def __init__(self, capacity: float, refill_per_s: float, limit: str = "bucket") -> None:
        for name, value in (("capacity", capacity), ("refill_per_s", refill_per_s)):
            if isinstance(value, bool) or not value > 0 or math.isinf(value):
                raise ValueError(f"{limit}: {name} must be a finite number > 0, got {value!r}")
        self._capacity = float(capacity)
        self._rate = float(refill_per_s)
        self._limit = limit
        self._tokens = float(capacity)
        self._updated_at: float | None = None  # the first call sets the clock's origin

    @classmethod
    def per_minute(cls, amount_per_minute: float, limit: str) -> TokenBucket:
        """A bucket allowing `amount_per_minute` per minute, all of it as one burst."""
        return cls(amount_per_minute, amount_per_minute / SECONDS_PER_MINUTE, limit)

    @property
    def capacity(self) -> float:
        return self._capacity

    def available(self, now: float) -> float:
        """Tokens in the bucket at `now`."""
        self._refill(now)
        return self._tokens

    def check(self, amount: float, now: float) -> Refusal | None:
        """Whether `amount` could be taken at `now`, without taking it.

        Raises:
            ValueError: `amount` is negative or not finite.
        """
        _check_amount("amount", amount)
        self._refill(now)
        if amount > self._capacity:
            return Refusal(self._limit, f"{amount:g} exceeds {self._limit}={self._capacity:g}", None)
        missing = amount - self._tokens
        if missing <= 0:
            return None
        return Refusal(self._limit, f"{self._limit} exceeded: {amount:g} requested, "
                                    f"{self._tokens:.0f} left", missing / self._rate)

    def try_take(self, amount: float, now: float) -> Refusal | None:
        """Take `amount` tokens if the bucket holds them; otherwise take nothing and say why.

        Raises:
            ValueError: `amount` is negative or not finite.
        """
        refusal = self.check(amount, now)
        if refusal is None:
            self._tokens -= amount
        return refusal

    def refund(self, amount: float, now: float) -> None:
        """Give back tokens taken but not used (never above capacity).

        Raises:
            ValueError: `amount` is negative or not finite.
        """
        _check_amount("amount", amount)
        self._refill(now)
        self._tokens = min(self._capacity, self._tokens + amount)

    def _refill(self, now: float) -> None:
        if self._updated_at is None:
            self._updated_at = now
        # A clock that steps back gives nothing and does not move the origin back: no double refill.
        elapsed = now - self._updated_at
        if elapsed > 0:
            self._tokens = min(self._capacity, self._tokens + elapsed * self._rate)
            self._updated_at = now


def _check_limit(name: str, value: int | None, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} or None (unlimited), got {value!r}")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits; None means unlimited.

    Args:
        requests_per_minute: chat/completion requests per minute (token bucket, burst = the limit).
        tokens_per_minute: estimated prompt + max output tokens per minute (token bucket).
        max_concurrent_jobs: fine-tuning jobs queued or running at once; 0 disables fine-tuning.
        max_training_tokens_per_job: training tokens of one job (tokens per epoch x epochs).
        max_stored_bytes: bytes the tenant stores: its uploaded files plus its jobs' adapter folders
            (checkpoints and final models) on disk.
        max_fine_tuned_models: fine-tuned models the tenant holds, checkpoints included; 0 disables
            fine-tuning.
        tinker_requests_per_minute: calls to the Tinker API's endpoints per minute, every endpoint
            (sessions, heartbeats, telemetry, training calls, samples, futures) counted (token bucket).
        max_stored_responses / max_stored_response_bytes: the Responses API's stored responses the tenant
            keeps, and the bytes of their JSON; past either, its least recently used ones are evicted.
        stored_response_ttl_s: seconds a stored response is kept after it was created or last continued.

    The tenants file fills the limits a tenant leaves out from `DEFAULT_LIMITS` (finite), so `None`
    (unlimited) is only what a tenants file says explicitly (`null`).

    Raises:
        ValueError: a limit is not an integer, or below 1 (below 0 for `max_concurrent_jobs`,
            `max_stored_bytes` and `max_fine_tuned_models`).
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_jobs: int | None = None
    max_training_tokens_per_job: int | None = None
    max_stored_bytes: int | None = None
    max_fine_tuned_models: int | None = None
    tinker_requests_per_minute: int | None = None
    max_stored_responses: int | None = None
    max_stored_response_bytes: int | None = None
    stored_response_ttl_s: int | None = None

    def __post_init__(self) -> None:
        _check_limit("requests_per_minute", self.requests_per_minute, 1)
        _check_limit("tokens_per_minute", self.tokens_per_minute, 1)
        _check_limit("max_concurrent_jobs", self.max_concurrent_jobs, 0)
        _check_limit("max_training_tokens_per_job", self.max_training_tokens_per_job, 1)
        _check_limit("max_stored_bytes", self.max_stored_bytes, 0)
        _check_limit("max_fine_tuned_models", self.max_fine_tuned_models, 0)
        _check_limit("tinker_requests_per_minute", self.tinker_requests_per_minute, 1)
        _check_limit("max_stored_responses", self.max_stored_responses, 0)
        _check_limit("max_stored_response_bytes", self.max_stored_response_bytes, 0)
        _check_limit("stored_response_ttl_s", self.stored_response_ttl_s, 1)


# What a tenant of the tenants file gets for a limit it does not set (docs/tenants.md): finite, so that a
# tenant the operator wrote no limits for cannot hold the machine (8 concurrent jobs and Tinker runs,
# 20 GiB stored, ...), and generous enough for one user's real work. `default_limits:` in the file
# replaces them; `null` for a limit means unlimited.
DEFAULT_LIMITS = TenantLimits(requests_per_minute=30_000, tokens_per_minute=50_000_000, max_concurrent_jobs=8,
                              max_training_tokens_per_job=100_000_000, max_stored_bytes=20 * 2**30,
                              max_fine_tuned_models=1000, tinker_requests_per_minute=6000,
                              max_stored_responses=10_000, max_stored_response_bytes=64 * 2**20,
                              stored_response_ttl_s=30 * 86_400)


class TenantQuota:
    """The live quota state of one tenant: its rate buckets and its job limits.

    Args:
        limits: the tenant's limits.
    """

    def __init__(self, limits: TenantLimits) -> None:
        self._limits = limits
        self._requests = (None if limits.requests_per_minute is None else
                          TokenBucket.per_minute(limits.requests_per_minute, "requests_per_minute"))
        self._tokens = (None if limits.tokens_per_minute is None else
                        TokenBucket.per_minute(limits.tokens_per_minute, "tokens_per_minute"))

    @property
    def limits(self) -> TenantLimits:
        return self._limits

    def admit_request(self, est_tokens: int, now: float, requests: int = 1) -> Refusal | None:
        """Admit one request estimated at `est_tokens` (prompt + max output), or refuse it.

        `requests` is what it takes from `requests_per_minute`: 0 for the second and later prompts of
        one completions request, which counts once.

        Atomic: when either bucket refuses, neither is charged. When both refuse, the refusal that
        cannot succeed (None) wins, else the longer wait (the request needs both).

        Raises:
            ValueError: `est_tokens` is negative.
        """
        _check_amount("est_tokens", est_tokens)
        _check_amount("requests", requests)
        refusals = [bucket.check(amount, now)
                    for bucket, amount in ((self._requests, requests), (self._tokens, est_tokens))
                    if bucket is not None]
        refused = [r for r in refusals if r is not None]
        if refused:
            return max(refused, key=lambda r: math.inf if r.retry_after_s is None else r.retry_after_s)
        if self._requests is not None:
            self._requests.try_take(requests, now)
        if self._tokens is not None:
            self._tokens.try_take(est_tokens, now)
        return None

    def refund(self, tokens: int, now: float) -> None:
        """Give back tokens a request was charged but did not use (estimate minus actual).

        Raises:
            ValueError: `tokens` is negative.
        """
        _check_amount("tokens", tokens)
        if self._tokens is not None:
            self._tokens.refund(tokens, now)

    def admit_job(self, active_jobs: int, training_tokens: int,
                  retry_after_s: float = JOB_RETRY_AFTER_S) -> Refusal | None:
        """Admit a new fine-tuning job, or refuse it. Size is checked first: a job too large never fits.

        Args:
            active_jobs: the tenant's jobs that count against the limit (queued or running).
            training_tokens: the new job's training tokens (tokens per epoch x epochs).
            retry_after_s: the hint given when the concurrency limit refuses.

        Raises:
            ValueError: a negative count.
        """
        _check_amount("active_jobs", active_jobs)
        _check_amount("training_tokens", training_tokens)
        limits = self._limits
        cap = limits.max_training_tokens_per_job
        if cap is not None and training_tokens > cap:
            return Refusal("max_training_tokens_per_job",
                           f"the job has {training_tokens} training tokens, over "
                           f"max_training_tokens_per_job={cap}", None)
        if limits.max_concurrent_jobs == 0:
            return Refusal("max_concurrent_jobs", "fine-tuning is disabled for this tenant "
                                                  "(max_concurrent_jobs=0)", None)
        if limits.max_concurrent_jobs is not None and active_jobs >= limits.max_concurrent_jobs:
            return Refusal("max_concurrent_jobs",
                           f"{active_jobs} fine-tuning jobs are active, the limit is "
                           f"max_concurrent_jobs={limits.max_concurrent_jobs}", retry_after_s)
        return None
