"""A DPO optimizer step outside the scheduler: the dedicated run's (Ray Train's) whole-sequence form of
the co-served pair schedule (`finetune.preference_batches`), with the same arithmetic.

Each pair's reference sums come from a forward pass through the base model with the adapter switched off
(`reference_sums`, once per pair: `fill_references` keeps them, and a checkpoint keeps the dict). A pair
then runs both its sequences forward under the adapter (`SequenceLogprob`: the summed completion
log-probs), gets its DPO coefficients from the four sums (`contract.preference.dpo_pair`, the batch mean
over its pairs), scales each sequence's gradient by its coefficient and runs both backwards. With a
`PreferenceSync` the ranks share the batch's pairs; the gradients, the metrics and newly computed
reference sums are summed over the ranks, so every rank takes the step one process would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from coserve.contract.preference import DpoMetrics, PairLogprobs, dpo_metrics, dpo_pair, validation_metrics
from coserve.trainer.optimizer import LoRAOptimizer, StepStats, TrainingSequence
from coserve.trainer.token_losses import SequenceLogprob
from coserve.trainer.windowed import SequenceState, WindowedTrainer, run_schedule

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PreferencePair:
    """A DPO example: the preferred and the non-preferred answer, each with its prompt."""

    chosen: TrainingSequence
    rejected: TrainingSequence

    @property
    def num_trained(self) -> int:
        return self.chosen.num_trained + self.rejected.num_trained


class PreferenceSync(Protocol):
    """Data parallelism for a DPO step (`data_parallel.ProcessGroupSync`)."""

    def shard(self, batch: list[T]) -> list[T]: ...

    def all_reduce(self, params: list[torch.Tensor], loss_sum: float) -> float: ...

    def sums(self, values: list[float]) -> list[float]:
        """Each value summed over every process (float64)."""
        ...


def _sequence_sum(trainer: WindowedTrainer, seq: TrainingSequence, *, adapter: bool) -> SequenceState:
    """`seq` run forward (one window) with its completion's summed log-prob in `loss_sum`."""
    state = trainer.start_sequence(seq.token_ids, seq.trained, 1, keep_inputs=adapter, loss=SequenceLogprob(),
                                   adapter=adapter)
    trainer.forward_window(state, state.length)
    return state


@torch.no_grad()
def reference_sums(trainer: WindowedTrainer, pair: PreferencePair) -> tuple[float, float]:
    """The pair's (chosen, rejected) summed log-probs under the base model alone."""
    return (_sequence_sum(trainer, pair.chosen, adapter=False).loss_sum,
            _sequence_sum(trainer, pair.rejected, adapter=False).loss_sum)


def fill_references(trainer: WindowedTrainer, pairs: Sequence[PreferencePair], indices: list[int],
                    known: dict[int, tuple[float, float]], sync: PreferenceSync | None = None) -> None:
    """Add the reference sums of the pairs `indices` that `known` lacks (each rank computes its share)."""
    missing = [i for i in dict.fromkeys(indices) if i not in known]
    values = [0.0] * (2 * len(missing))
    slots = list(enumerate(missing))
    for k, index in slots if sync is None else sync.shard(slots):
        values[2 * k], values[2 * k + 1] = reference_sums(trainer, pairs[index])
    if sync is not None:
        values = sync.sums(values)
    known.update({index: (values[2 * k], values[2 * k + 1]) for k, index in slots})


def _train_pair(trainer: WindowedTrainer, pair: PreferencePair, reference: tuple[float, float], beta: float,
                pairs_in_batch: int) -> tuple[PairLogprobs, float]:
    """Both forwards, the pair's coefficients, both backwards; returns its log-probs and its loss."""
    chosen = _sequence_sum(trainer, pair.chosen, adapter=True)
    rejected = _sequence_sum(trainer, pair.rejected, adapter=True)
    logprobs = PairLogprobs(chosen.loss_sum, rejected.loss_sum, *reference)
    result = dpo_pair(logprobs, beta, pairs_in_batch)
    chosen.scale_gradient(result.chosen_coefficient)
    rejected.scale_gradient(result.rejected_coefficient)
    for state in (chosen, rejected):
        run_schedule(trainer, state, [], [state.length])
    return logprobs, result.loss


@torch.no_grad()
def preference_validation(trainer: WindowedTrainer, pairs: list[PreferencePair], beta: float,
                          sync: PreferenceSync | None = None) -> dict[str, float]:
    """The validation pairs' DPO loss and rewards (`valid_` names), forward only."""
    slots = list(enumerate(pairs))
    values = [0.0] * (4 * len(pairs))
    for k, pair in slots if sync is None else sync.shard(slots):
        values[4 * k:4 * k + 2] = [_sequence_sum(trainer, seq, adapter=True).loss_sum
                                   for seq in (pair.chosen, pair.rejected)]
        values[4 * k + 2:4 * k + 4] = reference_sums(trainer, pair)
    if sync is not None:
        values = sync.sums(values)
    return validation_metrics([PairLogprobs(*values[4 * k:4 * k + 4]) for k in range(len(pairs))], beta)


def train_preference_batch(trainer: WindowedTrainer, optimizer: LoRAOptimizer, batch: list[PreferencePair],
                           references: list[tuple[float, float]], beta: float,
                           sync: PreferenceSync | None = None) -> tuple[StepStats, dict[str, float]]:
    """One DPO optimizer step over `batch` (the batch mean of the pairs' losses); returns the step's
    stats and its metrics (TRL's names, as the co-served job reports them)."""
    if not batch or len(references) != len(batch):
        raise ValueError(f"need pairs and one reference per pair, got {len(batch)} and {len(references)}")
    if trainer.lora is not optimizer.lora:
        raise ValueError("the trainer and the optimizer must share one TrainableLoRA")
    optimizer.zero_grad()
    work = list(zip(batch, references))
    records: list[PairLogprobs] = []
    for pair, reference in work if sync is None else sync.shard(work):
        records.append(_train_pair(trainer, pair, reference, beta, len(batch))[0])
    local = dpo_metrics([dpo_pair(r, beta, len(batch)) for r in records], records) if records else None
    sums = [len(records) * v for v in dataclasses.astuple(local)] if local else [0.0] * 7
    if sync is not None:
        sync.all_reduce(optimizer.params, 0.0)
        sums = sync.sums(sums)
    metrics = DpoMetrics(*[s / len(batch) for s in sums]).as_dict()
    stats = optimizer.step(loss=metrics["train_loss"], num_sequences=2 * len(batch),
                           num_tokens=sum(p.num_trained for p in batch))
    trainer.refresh_adapter()
    return stats, metrics
