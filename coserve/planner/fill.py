"""The share with no SLO: each iteration gives fine-tuning what inference leaves of its token budget.

Inference is planned first, as by every share (VTC order, chunked prefill, KV reclaim); the jobs then get
the rest of `max_batch_tokens` as forward-window tokens, and the same part of `max_backward_token_layers`
as backward token-layers, both at once (a sequence whose forward completes may start its backward in the
same plan). No latency target bounds an iteration, so the latency model only learns. It is the offline
`LLM`'s share (a cluster of one engine: `coserve.offline.llm`), where nothing waits on a token's latency.
"""

from __future__ import annotations

from coserve.finetune.roster import Allowance, whole_iteration_allowance
from coserve.planner.latency import PlanFeatures
from coserve.planner.strategy import IGNORE_REQUESTS, ShareContext


class FillShare:
    """Fine-tuning fills what inference leaves of each iteration (module docstring)."""

    label = "fill share"
    hosts_jobs = True
    floor_applies = False  # fine-tuning gets every iteration's rest, and whole iterations without inference
    kv_fraction = None
    watcher = IGNORE_REQUESTS
    learns_latency = False  # no SLO: nothing plans by latency here

    def begin_iteration(self, ctx: ShareContext) -> bool:
        return True

    def inference_token_budget(self, ctx: ShareContext) -> int:
        return ctx.config.scheduler.max_batch_tokens

    def allowance(self, ctx: ShareContext, base: PlanFeatures) -> Allowance | None:
        max_tokens = ctx.config.scheduler.max_batch_tokens
        left = max_tokens - int(base.prefill_tokens + base.decode_tokens)
        if left <= 0:
            return None
        return whole_iteration_allowance(left, ctx.config.max_backward_token_layers * left // max_tokens)
