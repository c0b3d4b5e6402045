"""Admission in the scheduler: may a token submission be queued? Its request id (its key) must not be
in use, and its tenant's request and token quotas must allow it; an admitted submission's adapter gets
its engine id here.

Quota state (`TenantQuota` token buckets) lives here, in the scheduler, so every gateway replica draws
from the same buckets. A request is charged its estimate (prompt + n x max output) when admitted and
refunded what it did not use when it ends. The checks that need the tokenizer (context length, the
adapter's files) ran in the gateway before (`coserve.frontend.intake`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coserve.contract.messages import AdapterSpec, Rejection, TokenSubmission
from coserve.contract.sampling import AdapterRef
from coserve.tenancy.quotas import TenantLimits, TenantQuota


class QuotaBook:
    """The live quotas of every tenant (absent tenants and limits: unlimited).

    Args:
        limits: tenant -> its limits (from the tenants file).
        clock: monotonic seconds.
    """

    def __init__(self, limits: Mapping[str, TenantLimits], clock: Callable[[], float] = time.monotonic) -> None:
        self._quotas = {name: TenantQuota(tenant_limits) for name, tenant_limits in limits.items()}
        self._clock = clock

    def estimate(self, tenant: str, prompt_len: int, n: int, max_tokens: int, client_limit: int | None) -> int:
        """Tokens charged at admission: prompt + n x max output. Without a client limit (max output =
        the room left in the context) the estimate is capped to the tenant's bucket, or every such
        request would be "too large"; the output is then not charged beyond the cap."""
        estimate = prompt_len + n * max_tokens
        quota = self._quotas.get(tenant)
        capacity = None if quota is None else quota.limits.tokens_per_minute
        if client_limit is None and capacity is not None:
            estimate = min(estimate, max(capacity, prompt_len))
        return estimate

    def admit(self, tenant: str, estimate: int, requests: int = 1) -> Rejection | None:
        """Charge one request of `estimate` tokens (`requests` from the request bucket: 0 for a
        completions request's later prompts), or say why not: 429 with `retry_after_s` when waiting
        helps, 400 when the request can never fit (more tokens than the bucket holds)."""
        quota = self._quotas.get(tenant)
        refusal = None if quota is None else quota.admit_request(estimate, self._clock(), requests)
        if refusal is None:
            return None
        if refusal.retry_after_s is None:
            return Rejection(400, f"Request too large for {refusal.limit}: {refusal.reason}. Reduce "
                                  "max_completion_tokens or the messages.", param="max_completion_tokens",
                             code="rate_limit_exceeded")
        kind = "requests" if refusal.limit == "requests_per_minute" else "tokens"
        return Rejection(429, f"Rate limit reached for tenant {tenant} on {refusal.limit}: {refusal.reason}. "
                              f"Please try again in {refusal.retry_after_s:.2f}s.", type=kind,
                         code="rate_limit_exceeded", retry_after_s=refusal.retry_after_s)

    def refund(self, tenant: str, tokens: int) -> None:
        """Give back tokens charged but not used (nothing when `tokens` <= 0)."""
        quota = self._quotas.get(tenant)
        if quota is not None and tokens > 0:
            quota.refund(tokens, self._clock())


@dataclass(frozen=True, slots=True)
class Charge:
    """An admitted submission: what its tenant was charged (refunded what it does not use) and the
    adapter it runs through (None: the base model)."""

    tenant: str
    estimate: int
    adapter: AdapterRef | None


class AdmissionControl:
    """Admits token submissions: one key per live request, the tenants' quotas, adapter ids.

    Args:
        limits: tenant -> its limits (from the tenants file; absent: unlimited).
        clock: monotonic seconds.
    """

    def __init__(self, limits: Mapping[str, TenantLimits], clock: Callable[[], float] = time.monotonic) -> None:
        self._quotas = QuotaBook(limits, clock)
        self._adapter_ids: dict[str, int] = {}  # adapter folder -> engine adapter id (>= 1)

    def admit(self, sub: TokenSubmission, key_in_use: bool) -> Charge | Rejection:
        """Charge `sub` against its tenant's quotas, or say why it cannot be queued.

        Args:
            key_in_use: a live submission already has `sub.request_id`.
        """
        if key_in_use:
            return Rejection(409, f"A request with id {sub.request_id!r} is already in progress.",
                             param="request_id", code="duplicate_request")
        sampling = sub.sampling
        assert sampling.max_tokens is not None  # the frontend sets it (`TokenSubmission.sampling`)
        estimate = self._quotas.estimate(sub.tenant, len(sub.prompt_token_ids), sampling.n, sampling.max_tokens,
                                         client_limit=sub.client_max_tokens)
        refusal = self._quotas.admit(sub.tenant, estimate, requests=int(sub.counts_request))
        if refusal is not None:
            return refusal
        return Charge(sub.tenant, estimate, self._adapter_ref(sub.adapter))

    def refund(self, tenant: str, tokens: int) -> None:
        """Give back tokens charged but not used (nothing when `tokens` <= 0)."""
        self._quotas.refund(tenant, tokens)

    def _adapter_ref(self, spec: AdapterSpec | None) -> AdapterRef | None:
        """The engine's handle on an adapter: one id per folder, for as long as the scheduler lives."""
        if spec is None:
            return None
        adapter_id = self._adapter_ids.setdefault(spec.path, len(self._adapter_ids) + 1)
        return AdapterRef(adapter_id=adapter_id, name=spec.name, path=spec.path)
