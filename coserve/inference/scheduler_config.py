"""Settings of the inference scheduler, validated once and frozen, and their defaults: the one place
the server (`coserve serve`, `SchedulerSettings`), the offline `LLM` and the policies take them from."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.contract import defaults


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Budgets of one engine iteration and of the running batch.

    Raises:
        ValueError: a setting is out of range; the message names it and its value.
    """

    max_model_len: int
    """Longest sequence (prompt + output) in tokens; a request stops with `length` when it gets there."""

    max_num_seqs: int = defaults.MAX_NUM_SEQS
    """Requests running at once (each holds KV blocks and, maybe, an adapter pin)."""

    max_batch_tokens: int = defaults.MAX_BATCH_TOKENS
    """Tokens computed in one iteration over all requests; longer prefills are split into chunks."""

    block_size: int = defaults.BLOCK_SIZE
    """Token positions per KV block; must equal the KV block manager's."""

    enable_prefix_caching: bool = True
    """Reuse the K/V of full blocks that an earlier request with the same prefix and adapter computed."""

    long_prefill_threshold: int = 0
    """Tokens one request may compute per iteration at most (0: no cap beyond max_batch_tokens).
    Caps a long prompt's share of a step so that other prefills are not starved behind it."""

    def __post_init__(self) -> None:
        at_least_one = {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_batch_tokens": self.max_batch_tokens,
            "block_size": self.block_size,
        }
        for name, value in at_least_one.items():
            if value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {value}")
        if self.long_prefill_threshold < 0:
            raise ValueError("SchedulerConfig.long_prefill_threshold must be >= 0 (0 turns it off), "
                             f"got {self.long_prefill_threshold}")
