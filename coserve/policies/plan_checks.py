"""Invariants every policy's plan must hold before it is sent; a failure is a bug, not bad input.

Shared by the policies (FCFS checks its whole plan; the co-serving policies check the token budget
with their fine-tuning tokens added). They run on every iteration, so they read chunks with
`map`/`attrgetter` rather than a Python loop.
"""

from __future__ import annotations

from operator import attrgetter

from coserve.policies.plan import IterationPlan

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
