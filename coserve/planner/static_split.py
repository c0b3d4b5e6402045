"""Static split baseline: inference and fine-tuning each own a fixed part of the machine.

What "separate capacity on one machine" means here, and why it is honest:

* **Memory**: the engine's KV cache is cut into two disjoint block ranges (`split_kv`): inference
  requests allocate only from theirs, fine-tuning sequences only from theirs. Neither side ever uses
  the other's free blocks, and fine-tuning never yields blocks to inference (as with two GPUs, or MIG
  slices, there is nothing to take back).
* **Compute**: every iteration has room for `max_batch_tokens` tokens; inference gets
  `(1 - finetune_fraction)` of them and fine-tuning the rest, as forward-window tokens, or the same
  fraction of `max_backward_token_layers` as backward token-layers. The fine-tuning share is taken
  whatever the inference load and is not given to inference when no job runs (a partition is
  provisioned for its peak, FlexLLM §2's "resource isolation"). Running both shares in one fused
  iteration charges inference the slowdown a shared GPU partition would cause, and no latency model
  adjusts either share.

`StaticSplitShare` is the share; the co-serving policy is given the two ranges (`split_kv`) and builds
jobs on the fine-tuning one.
"""

from __future__ import annotations

from coserve.finetune.roster import Allowance, fixed_allowance
from coserve.inference.kv_blocks import KVBlockManager
from coserve.planner.latency import PlanFeatures
from coserve.planner.settings import CoServingConfig
from coserve.planner.strategy import IGNORE_REQUESTS, ShareContext

DEFAULT_FINETUNE_FRACTION = 0.3


def _check_fraction(fraction: float) -> None:
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"finetune_fraction must be in (0, 1), got {fraction!r}")


def split_kv(num_blocks: int, block_size: int, finetune_fraction: float,
             enable_prefix_caching: bool = True) -> tuple[KVBlockManager, KVBlockManager]:
    """Two managers over disjoint ranges of one cache: (inference, fine-tuning).

    Raises:
        ValueError: the fraction is not in (0, 1), or a side would get no block.
    """
    _check_fraction(finetune_fraction)
    finetune_blocks = int(num_blocks * finetune_fraction)
    inference_blocks = num_blocks - finetune_blocks
    if finetune_blocks < 1 or inference_blocks < 1:
        raise ValueError(f"finetune_fraction={finetune_fraction} of {num_blocks} blocks leaves a side "
                         "with no KV block")
    inference = KVBlockManager(inference_blocks, block_size, enable_prefix_caching)
    finetune = KVBlockManager(finetune_blocks, block_size, enable_prefix_caching, first_block=inference_blocks)
    return inference, finetune


class StaticSplitShare:
    """Fixed shares of every iteration for inference and fine-tuning (module docstring); the policy
    gives fine-tuning its own KV range and never reclaims it.

    Args:
        config: the policy's settings (the shares are fractions of its budgets).
        finetune_fraction: the fine-tuning share of each iteration's token and token-layer budgets.

    Raises:
        ValueError: the fraction is not in (0, 1), or a share of the iteration budget is empty.
    """

    hosts_jobs = True
    floor_applies = True
    learns_latency = True
    watcher = IGNORE_REQUESTS

    def __init__(self, config: CoServingConfig, finetune_fraction: float = DEFAULT_FINETUNE_FRACTION) -> None:
        _check_fraction(finetune_fraction)
        tokens = config.scheduler.max_batch_tokens
        self._finetune_tokens = int(tokens * finetune_fraction)
        self._finetune_token_layers = int(config.max_backward_token_layers * finetune_fraction)
        if self._finetune_tokens < 1 or self._finetune_token_layers < 1:
            raise ValueError(f"finetune_fraction={finetune_fraction} leaves fine-tuning no token of "
                             f"max_batch_tokens={tokens} or max_backward_token_layers")
        if tokens - self._finetune_tokens < config.scheduler.max_num_seqs:
            raise ValueError(f"finetune_fraction={finetune_fraction} leaves inference fewer tokens than "
                             f"one decode batch of max_num_seqs={config.scheduler.max_num_seqs}")
        self.finetune_fraction = finetune_fraction
        self.kv_fraction: float | None = finetune_fraction  # the fine-tuning range is not inference's
        self.label = f"static split share ({finetune_fraction:g})"

    def begin_iteration(self, ctx: ShareContext) -> bool:
        return True

    def inference_token_budget(self, ctx: ShareContext) -> int:
        return ctx.config.scheduler.max_batch_tokens - self._finetune_tokens

    def allowance(self, ctx: ShareContext, base: PlanFeatures) -> Allowance | None:
        return fixed_allowance(self._finetune_tokens, self._finetune_token_layers)
