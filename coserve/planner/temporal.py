"""Temporal sharing baselines: inference and fine-tuning take turns on the whole engine.

An inference iteration is planned as by the hybrid policy without fine-tuning work; a fine-tuning
iteration runs fine-tuning alone (running requests wait), as much as one iteration may hold:
`max_batch_tokens` forward-window tokens or `max_backward_token_layers` backward token-layers, jobs
in VTC order, with no latency limit. That is the cost temporal sharing pays (FlexLLM §8, Fig. 11):
decodes stall for a whole fine-tuning iteration. FlexLLM's fine-tuning turn is a full training step;
here a turn is one engine iteration, so a training step spans several turns.

`TurnTakingShare` plans the turns; when a fine-tuning turn is due is its `TurnSchedule`'s: every n
inference iterations (`FixedTurns`), or FlexLLM's adaptive interval (`dynamic_temporal.DynamicTurns`).

Both baselines are work-conserving across the two kinds: with no inference work, every iteration
goes to fine-tuning; with no runnable job, every iteration goes to inference.
"""

from __future__ import annotations

from typing import Protocol

from coserve.finetune.roster import Allowance, fixed_allowance
from coserve.planner.latency import PlanFeatures
from coserve.planner.strategy import IGNORE_REQUESTS, RequestWatcher, ShareContext

DEFAULT_INFERENCE_ITERATIONS = 64  # FlexLLM sweeps 64..512


class TurnSchedule(Protocol):
    """When a fine-tuning turn is due."""

    def finetune_turn_due(self, ctx: ShareContext) -> bool:
        """Called once per iteration (advancing the turn state): is a fine-tuning iteration due?"""


class TurnTakingShare:
    """Inference iterations and fine-tuning iterations in turns, as `turns` says (module docstring);
    `watcher` is what the turns follow of the requests."""

    hosts_jobs = True
    # Turns give fine-tuning whole iterations by construction (at least one every n, and every one
    # without inference): a floor piece inside an inference turn would break the baseline's contract.
    floor_applies = False
    learns_latency = True
    kv_fraction = None

    def __init__(self, turns: TurnSchedule, label: str, watcher: RequestWatcher = IGNORE_REQUESTS) -> None:
        self.turns = turns
        self.label = label
        self.watcher = watcher
        self._finetune_turn = False

    def begin_iteration(self, ctx: ShareContext) -> bool:
        due = self.turns.finetune_turn_due(ctx)
        has_inference = ctx.num_running > 0 or ctx.num_waiting > 0
        self._finetune_turn = ctx.has_runnable_job() and (due or not has_inference)
        return not self._finetune_turn

    def inference_token_budget(self, ctx: ShareContext) -> int:
        return ctx.config.scheduler.max_batch_tokens

    def allowance(self, ctx: ShareContext, base: PlanFeatures) -> Allowance | None:
        if not self._finetune_turn:
            return None
        return fixed_allowance(ctx.config.scheduler.max_batch_tokens, ctx.config.max_backward_token_layers)


class FixedTurns:
    """n inference iterations, then one fine-tuning iteration (FlexLLM's temporal sharing baseline).

    Args:
        inference_iterations: n, inference iterations per fine-tuning iteration (FlexLLM sweeps
            64..512).

    Raises:
        ValueError: `inference_iterations` < 1.
    """

    def __init__(self, inference_iterations: int = DEFAULT_INFERENCE_ITERATIONS) -> None:
        if inference_iterations < 1:
            raise ValueError(f"inference_iterations must be >= 1, got {inference_iterations}")
        self._n = inference_iterations
        self._since_finetune = 0

    def finetune_turn_due(self, ctx: ShareContext) -> bool:
        self._since_finetune += 1
        if self._since_finetune > self._n:
            self._since_finetune = 0
            return True
        return False


def temporal_share(inference_iterations: int = DEFAULT_INFERENCE_ITERATIONS) -> TurnTakingShare:
    """Temporal sharing: a fine-tuning iteration after every `inference_iterations` inference ones."""
    return TurnTakingShare(FixedTurns(inference_iterations), f"temporal share (n={inference_iterations})")
