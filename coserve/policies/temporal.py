"""Temporal sharing baselines: inference and fine-tuning take turns on the whole engine.

An inference iteration is planned as by the hybrid policy without fine-tuning work; a fine-tuning
iteration runs fine-tuning alone (running requests wait), as much as one iteration may hold:
`max_batch_tokens` forward-window tokens or `max_backward_token_layers` backward token-layers, jobs
in VTC order, with no latency limit. That is the cost temporal sharing pays (FlexLLM §8, Fig. 11):
decodes stall for a whole fine-tuning iteration. FlexLLM's fine-tuning turn is a full training step;
here a turn is one engine iteration, so a training step spans several turns.

Both baselines are work-conserving across the two kinds: with no inference work, every iteration
goes to fine-tuning; with no runnable job, every iteration goes to inference.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable

from coserve.policies.adapter_slots import AdapterSlots
from coserve.policies.coserving import CoServingPolicy
from coserve.policies.hybrid_config import CoServingConfig
from coserve.policies.job_roster import Allowance, fixed_allowance
from coserve.policies.kv_blocks import KVBlockManager
from coserve.policies.latency import LatencyModel, PlanFeatures


class TurnTakingPolicy(CoServingPolicy, abc.ABC):
    """Inference iterations and fine-tuning iterations in turns; subclasses say when a turn is due."""

    _finetune_turn = False
    # Turns give fine-tuning whole iterations by construction (at least one every n, and every one
    # without inference): a floor piece inside an inference turn would break the baseline's contract.
    _floor_enabled = False

    @abc.abstractmethod
    def _finetune_turn_due(self) -> bool:
        """Called once per iteration (advancing the turn state): is a fine-tuning iteration due?"""

    def _begin_iteration(self) -> bool:
        due = self._finetune_turn_due()
        has_inference = self.num_running > 0 or self.num_waiting > 0
        self._finetune_turn = self._has_runnable_job() and (due or not has_inference)
        return not self._finetune_turn

    def _finetune_allowance(self, base: PlanFeatures) -> Allowance | None:
        if not self._finetune_turn:
            return None
        return fixed_allowance(self._co.scheduler.max_batch_tokens, self._co.max_backward_token_layers)


class TemporalSharingPolicy(TurnTakingPolicy):
    """n inference iterations, then one fine-tuning iteration (FlexLLM's temporal sharing baseline).

    Args:
        inference_iterations: n, inference iterations per fine-tuning iteration (FlexLLM sweeps
            64..512).
        (the rest): as `CoServingPolicy`.

    Raises:
        ValueError: `inference_iterations` < 1.
    """

    def __init__(self, config: CoServingConfig, kv: KVBlockManager, adapters: AdapterSlots,
                 latency: LatencyModel, *, inference_iterations: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if inference_iterations < 1:
            raise ValueError(f"inference_iterations must be >= 1, got {inference_iterations}")
        self._n = inference_iterations
        self._since_finetune = 0
        super().__init__(config, kv, adapters, latency, clock=clock)

    def _finetune_turn_due(self) -> bool:
        self._since_finetune += 1
        if self._since_finetune > self._n:
            self._since_finetune = 0
            return True
        return False
