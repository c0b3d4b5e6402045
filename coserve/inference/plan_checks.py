"""Invariants every policy's plan must hold before it is sent; a failure is a bug, not bad input.

Shared by the policies (the inference scheduler checks its whole plan; the co-serving policy checks
the token budget with its fine-tuning tokens added), with the check that a KV cache fits the
scheduler's settings. They run on every iteration, so they read chunks with
`map`/`attrgetter` rather than a Python loop.
"""

from __future__ import annotations

from operator import attrgetter

from coserve.contract.plan import IterationPlan
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.scheduler_config import SchedulerConfig

_NUM_TOKENS = attrgetter("num_tokens")
_REQUEST_ID = attrgetter("request_id")


def check_token_budget(plan: IterationPlan, max_batch_tokens: int) -> None:
    """No empty chunk, and the chunks' tokens within `max_batch_tokens`. Raises RuntimeError."""
    counts = list(map(_NUM_TOKENS, plan.chunks))
    if sum(counts) > max_batch_tokens:
        raise RuntimeError(f"plan {plan.step_id} has {sum(counts)} tokens, over "
                           f"max_batch_tokens={max_batch_tokens}")
    if counts and min(counts) < 1:
        raise RuntimeError(f"plan {plan.step_id} has an empty chunk: {counts}")


def check_sequences(plan: IterationPlan, num_running: int, max_num_seqs: int) -> None:
    """At most `max_num_seqs` running, and no request scheduled twice. Raises RuntimeError."""
    if num_running > max_num_seqs:
        raise RuntimeError(f"{num_running} running requests, over max_num_seqs={max_num_seqs}")
    if len(set(map(_REQUEST_ID, plan.chunks))) != len(plan.chunks):
        raise RuntimeError(f"plan {plan.step_id} schedules a request twice: "
                           f"{[c.request_id for c in plan.chunks]}")


def check_kv_matches(config: SchedulerConfig, kv: KVBlockManager) -> None:
    """Raise ValueError when `kv` disagrees with `config` (block size, prefix caching), or a sequence of
    `max_model_len` tokens needs more blocks than the KV cache has."""
    if kv.block_size != config.block_size:
        raise ValueError(f"KV block size {kv.block_size} != SchedulerConfig.block_size "
                         f"{config.block_size}")
    if kv.enable_prefix_caching != config.enable_prefix_caching:
        raise ValueError(f"KV prefix caching {kv.enable_prefix_caching} != "
                         f"SchedulerConfig.enable_prefix_caching {config.enable_prefix_caching}")
    if -(-config.max_model_len // kv.block_size) > kv.num_blocks:
        # Otherwise one long request could be preempted forever, alone in the cache.
        raise ValueError(f"max_model_len={config.max_model_len} needs more than the "
                         f"{kv.num_blocks} KV blocks of {kv.block_size} tokens")
