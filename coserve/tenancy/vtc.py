"""Virtual token counters: weighted fair sharing of inference and fine-tuning tokens among tenants.

This is FlexLLM's Algorithm 4 (Appendix C of `seeds/flexllm-nsdi26.txt`), itself VTC (Sheng et al.,
OSDI 2024) extended with fine-tuning tokens. Every tenant i has a counter c_i of the weighted service it
received, divided by its weight; the backlogged tenant with the smallest counter goes next, for inference
admission and for fine-tuning tokens alike.

Charges (all divided by the tenant's weight):

- input (prefill) tokens: `w_p` per token, charged when the request is admitted (line 20), the whole
  prompt at once even when its prefill is chunked over several iterations, as VTC does;
- output (decode) tokens: `w_q` per generated token, every iteration (line 30);
- fine-tuning tokens: `w_r` per token actually processed in an iteration (lines 25-26).

**How fine-tuning work is charged.** One fine-tuning token is one token of a training sequence passing
through all `num_layers` layers once. A forward window of s tokens charges `w_r * s`. A backward tasklet
recomputes and back-propagates `k` of the `num_layers` layers over a window of s tokens, so it charges
`w_r * s * k / num_layers` fine-tuning tokens (`backward_tasklet_tokens`): a full backward over a window
of s tokens, however it is split into tasklets, charges `w_r * s` once. A training token therefore costs
`2 * w_r` over its forward and its backward (the optimizer step is not charged: it is per job, not per
token). Operators who want the backward's real cost (about twice a forward) reflected set `w_r` higher.

**Backlogged** means "has work waiting" (the paper's Q): queued inference requests or unfinished
fine-tuning work. The scheduler reports the transitions: `on_backlogged` when a tenant gets work
(every arrival may call it; only an empty -> non-empty transition lifts), `on_idle` when its queue
empties. The counter keeps the backlogged set itself because the lift needs it, and in particular needs
"the last tenant that left Q", which only a history of transitions can answer.

Everything is pure and deterministic: ties go to the smallest tenant name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def _check_positive(name: str, value: float) -> None:
    # `not value > 0` also rejects NaN, which compares false to everything.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class VTCWeights:
    """Cost of one token of each kind, before division by the tenant's weight.

    Args:
        w_p: per input (prefill) token. VTC uses 1.
        w_q: per output (decode) token. VTC uses 2, following OpenAI's pricing.
        w_r: per fine-tuning token (one token through all layers, forward or backward).

    Raises:
        ValueError: a weight is not a finite number > 0 (the message names it).
    """

    w_p: float = 1.0
    w_q: float = 2.0
    w_r: float = 1.0

    def __post_init__(self) -> None:
        for name in ("w_p", "w_q", "w_r"):
            _check_positive(name, getattr(self, name))

    def fairness_bound(self, max_input_len: int, max_tokens: int) -> float:
        """U = max(w_p * L_input, max(w_q, w_r) * M) of FlexLLM's Lemma 1 (Theorem 1 allows 2U).

        Args:
            max_input_len: L_input, the longest prompt admitted at once.
            max_tokens: M, the most output or fine-tuning tokens one tenant is charged in one step.
        """
        return max(self.w_p * max_input_len, max(self.w_q, self.w_r) * max_tokens)


def backward_tasklet_tokens(num_tokens: int, num_layers_done: int, num_layers: int) -> float:
    """Fine-tuning tokens a backward tasklet is charged: `num_tokens * num_layers_done / num_layers`.

    Raises:
        ValueError: negative tokens, `num_layers < 1`, or `num_layers_done` outside [0, num_layers].
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 0 <= num_layers_done <= num_layers:
        raise ValueError(f"num_layers_done must be in [0, {num_layers}], got {num_layers_done}")
    return num_tokens * num_layers_done / num_layers


class VirtualTokenCounter:
    """FlexLLM Algorithm 4's per-tenant counters, the lift, and the least-counter selection.

    Args:
        weights: token costs `w_p`, `w_q`, `w_r`.
        tenant_weights: tenant name -> share under contention (> 0); more can be added later.

    Raises:
        ValueError: a tenant weight is not a finite number > 0.
    """

    def __init__(self, weights: VTCWeights, tenant_weights: Mapping[str, float] | None = None) -> None:
        self._weights = weights
        self._share: dict[str, float] = {}
        self._counter: dict[str, float] = {}
        self._backlogged: set[str] = set()
        self._last_left: str | None = None  # the last tenant that left Q (Algorithm 4, line 8)
        for tenant, weight in (tenant_weights or {}).items():
            self.add_tenant(tenant, weight)

    # ------------------------------------------------------------------------------ tenants

    def add_tenant(self, tenant: str, weight: float = 1.0) -> None:
        """Register a tenant with counter 0 (line 2); the lift keeps that 0 from being a credit.

        Raises:
            ValueError: the tenant exists, or its weight is not a finite number > 0.
        """
        _check_positive(f"weight of tenant {tenant!r}", weight)
        if tenant in self._share:
            raise ValueError(f"tenant {tenant!r} is already registered")
        self._share[tenant] = float(weight)
        self._counter[tenant] = 0.0

    def ensure_tenant(self, tenant: str, weight: float) -> None:
        """Register `tenant` with `weight` unless it is registered already (then its weight stays)."""
        if tenant not in self._share:
            self.add_tenant(tenant, weight)

    @property
    def weights(self) -> VTCWeights:
        return self._weights

    @property
    def tenants(self) -> tuple[str, ...]:
        """Registered tenants, sorted by name."""
        return tuple(sorted(self._share))

    def weight(self, tenant: str) -> float:
        """The tenant's share under contention."""
        return self._share[self._known(tenant)]

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter c_i (weighted service divided by its weight)."""
        return self._counter[self._known(tenant)]

    def counters(self) -> dict[str, float]:
        """A copy of every counter."""
        return dict(self._counter)

    @property
    def backlogged(self) -> frozenset[str]:
        """Tenants with work waiting (the paper's Q)."""
        return frozenset(self._backlogged)

    @property
    def last_left(self) -> str | None:
        """The tenant that most recently became idle, or None before anyone did."""
        return self._last_left

    # ---------------------------------------------------------------------- backlog changes

    def on_backlogged(self, tenant: str) -> bool:
        """Report that `tenant` has work; lift its counter if it was idle (Algorithm 4, lines 5-12).

        Safe to call on every arrival: a tenant already backlogged is left as it is (line 6).

        Returns:
            True when the tenant was idle and became backlogged (the lift was applied).

        Raises:
            ValueError: unknown tenant.
        """
        self._known(tenant)
        if tenant in self._backlogged:  # line 6: u already has requests in Q, no lift
            return False
        if self._backlogged:
            # Line 11: c_u <- max{c_u, min{c_i | i in Q}}. Q does not hold u yet, so the minimum is
            # over the *other* backlogged tenants: an idle tenant cannot bank credit while away.
            floor = min(self._counter[i] for i in self._backlogged)
        elif self._last_left is not None:
            # Lines 7-9: Q is empty, lift to the last tenant that left it, l. Without this branch (the
            # VTC artifact skips it) a tenant idle while others were served would keep its stale low
            # counter and, once the others return, be served alone until it catches up.
            floor = self._counter[self._last_left]
        else:
            floor = self._counter[tenant]  # nobody was ever backlogged: nothing to lift to
        self._counter[tenant] = max(self._counter[tenant], floor)
        self._backlogged.add(tenant)  # line 12
        return True

    def on_idle(self, tenant: str) -> bool:
        """Report that `tenant` has no work waiting any more; it becomes the last tenant to leave Q.

        Returns:
            True when the tenant was backlogged (False: it already was idle, nothing changes).

        Raises:
            ValueError: unknown tenant.
        """
        self._known(tenant)
        if tenant not in self._backlogged:
            return False
        self._backlogged.discard(tenant)
        self._last_left = tenant
        return True

    # ------------------------------------------------------------------------------ selection

    def select(self, candidates: Iterable[str] | None = None) -> str | None:
        """The tenant to serve next: least counter among `candidates` (lines 17 and 23).

        Args:
            candidates: backlogged tenants that have work of the kind being scheduled (inference
                requests for admission, fine-tuning work for fine-tuning tokens); None: every
                backlogged tenant.

        Returns:
            The tenant with the smallest counter, ties to the smallest name; None only when there is
            no candidate (work-conserving: some tenant is returned whenever one has work).

        Raises:
            ValueError: a candidate is unknown or was not reported backlogged (its lift would have
                been skipped, which breaks the fairness bound).
        """
        pool = self._backlogged if candidates is None else candidates
        best: tuple[float, str] | None = None
        for tenant in pool:
            if tenant not in self._backlogged:
                self._known(tenant)
                raise ValueError(f"tenant {tenant!r} is not backlogged: call on_backlogged first")
            key = (self._counter[tenant], tenant)
            if best is None or key < best:
                best = key
        return None if best is None else best[1]

    # -------------------------------------------------------------------------------- charges

    def charge_input(self, tenant: str, num_tokens: int) -> float:
        """Charge an admitted request's prompt: `w_p * num_tokens / weight` (line 20).

        Returns:
            The tenant's new counter.
        """
        return self._charge(tenant, self._weights.w_p, num_tokens)

    def charge_output(self, tenant: str, num_tokens: int) -> float:
        """Charge generated tokens: `w_q * num_tokens / weight` (line 30). Returns the new counter."""
        return self._charge(tenant, self._weights.w_q, num_tokens)

    def charge_finetune(self, tenant: str, num_tokens: float) -> float:
        """Charge processed fine-tuning tokens: `w_r * num_tokens / weight` (line 26).

        `num_tokens` may be fractional: a backward tasklet over part of the layers is charged
        `backward_tasklet_tokens(...)`. Returns the new counter.
        """
        return self._charge(tenant, self._weights.w_r, num_tokens)

    def _charge(self, tenant: str, cost: float, num_tokens: float) -> float:
        self._known(tenant)
        if isinstance(num_tokens, bool) or not num_tokens >= 0 or math.isinf(num_tokens):
            raise ValueError(f"num_tokens must be a finite number >= 0, got {num_tokens!r}")
        self._counter[tenant] += cost * num_tokens / self._share[tenant]
        return self._counter[tenant]

    def _known(self, tenant: str) -> str:
        if tenant not in self._share:
            raise ValueError(f"unknown tenant {tenant!r}: add_tenant first")
        return tenant
