"""Admission checks of the scheduler: the context length and the tenants' request/token quotas.

Quota state (`TenantQuota` token buckets) lives here, in the scheduler, so every gateway replica draws
from the same buckets. A request is charged its estimate (prompt + n x max output) when admitted and
refunded what it did not use when it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from coserve.contract.messages import Rejection
from coserve.policies.quotas import TenantLimits, TenantQuota


def context_rejection(prompt_len: int, max_tokens: int | None, max_model_len: int, *,
                      at_least: bool = False, param: str = "messages") -> Rejection | None:
    """400 `context_length_exceeded` when the prompt plus the requested output (at least one token)
    does not fit the context; None when it does. `at_least`: `prompt_len` is a lower bound (the prompt
    was too long to be worth encoding), and the message says so. `param`: where the prompt came from
    (`messages` for chat, `prompt` for completions)."""
    wanted = prompt_len + (max_tokens or 1)
    if wanted <= max_model_len:
        return None
    some = "at least " if at_least else ""
    detail = f"{some}{prompt_len} in the {param}" + (f", {max_tokens} in the completion" if max_tokens else "")
    return Rejection(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                          f"requested {some}{wanted} tokens ({detail}). Please reduce the length of the "
                          f"{param} or completion.", param=param, code="context_length_exceeded")


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
