"""Every Tinker endpoint's calls, per tenant, under its `tinker_requests_per_minute` (a token bucket).

The tenant's bucket is taken from before the endpoint does anything (`admit`, in the router's tenant
dependency): sessions, sampling sessions, heartbeats, telemetry, training calls, samples, futures and
checkpoint listings all count one. A refusal is a 429 with `Retry-After`, which the SDK honours and
retries. The buckets are the gateway's own: on Ray, each gateway replica keeps its own (a tenant's
calls spread over the replicas, so its rate is at most the limit times the replicas).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from coserve.api.protocol.base import ProtocolError
from coserve.tenancy.quotas import TenantLimits, TokenBucket


class TinkerRates:
    """The tenants' buckets (module docstring); `clock` is seconds on a monotonic scale."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, TokenBucket | None] = {}

    def admit(self, tenant: str, limits: TenantLimits) -> None:
        """Take one call from the tenant's bucket.

        Raises:
            ProtocolError: 429 `rate_limit_exceeded` with `Retry-After` when the bucket is empty.
        """
        if tenant not in self._buckets:
            per_minute = limits.tinker_requests_per_minute
            self._buckets[tenant] = None if per_minute is None else TokenBucket.per_minute(
                per_minute, "tinker_requests_per_minute")
        bucket = self._buckets[tenant]
        refusal = None if bucket is None else bucket.try_take(1, self._clock())
        if refusal is None:
            return
        wait = refusal.retry_after_s or 1.0
        raise ProtocolError(f"Tinker API rate limit: {refusal.reason} (tinker_requests_per_minute). Retry "
                            f"in {wait:.1f} s.", status=429, type="rate_limit_error", code="rate_limit_exceeded",
                            headers={"retry-after": str(max(1, math.ceil(wait))),
                                     "retry-after-ms": str(max(1, math.ceil(wait * 1000)))})
