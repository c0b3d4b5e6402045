"""What the engine keeps of each fine-tuning job and each of its sequences in flight (`TrainingRuntime`'s
state), and the gradient snapshots that undo a sequence or a driven run's call.

A job's `.grad` accumulates every trained sequence's backward until its optimizer step. Each trained
sequence keeps the gradient it found at its start (`TrainingSequence.grad_before`), so dropping it (KV
reclaim, or an error in its own work) puts the gradient back as if it never ran. A sequence started with
`SequenceStart.marks_gradient` (the first of a driven run's call) also sets the job's `GradientMark`, which
`TrainingWork.gradient_rollbacks` restores: the whole call is undone, its earlier sequences too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.preference import DpoPair, PairLogprobs, dpo_pair
from coserve.contract.training_plan import PairStart, SequenceStart
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.optimizer import LoRAOptimizer
from coserve.trainer.token_losses import SequenceLogprob, TokenLoss, token_loss
from coserve.trainer.windowed import SequenceState, WindowedTrainer


class JobError(Exception):
    """A job cannot go on; `code` goes into the job's error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


Tensors = list[tuple[torch.Tensor, torch.Tensor]]  # (token ids, trained mask) per example
Gradient = list[torch.Tensor | None]  # a job's `.grad`, parameter by parameter


def snapshot_gradient(lora: TrainableLoRA) -> Gradient:
    """A copy of the adapter's `.grad` (None where there is none yet)."""
    return [None if p.grad is None else p.grad.clone() for p in lora.parameters()]


def restore_gradient(lora: TrainableLoRA, gradient: Gradient) -> None:
    """Put `gradient` back as the adapter's `.grad` (copies: later backwards accumulate into them)."""
    for param, saved in zip(lora.parameters(), gradient, strict=True):
        param.grad = None if saved is None else saved.clone()


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError when a token id is outside the model's vocabulary (its embedding would fail, on a
    GPU with a device-side assert that ends the process's CUDA context)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")


@dataclass(slots=True)
class GradientMark:
    """A job's gradient and batch sums before the first sequence of a driven run's call."""

    sequence_id: str
    gradient: Gradient
    batch_loss_sum: float
    batch_pairs: list[tuple[DpoPair, PairLogprobs]]


@dataclass(slots=True)
class TrainingJobState:
    """One job in the engine: its trainable adapter, optimizer, trainer and tokenized data."""

    lora: TrainableLoRA
    optimizer: LoRAOptimizer
    trainer: WindowedTrainer
    slot: int
    examples: Tensors
    validation: Tensors
    base_model_name_or_path: str | None
    loss: LossSpec
    rejected: Tensors  # a DPO job's rejected answers (per example), and its validation pairs'
    validation_rejected: Tensors
    batch_loss_sum: float = 0.0  # token losses of the batch's completed sequences
    batch_pairs: list[tuple[DpoPair, PairLogprobs]] = field(default_factory=list)  # a DPO batch's
    mark: GradientMark | None = None  # set by a sequence that `marks_gradient`

    def example(self, start: SequenceStart, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's tokens and trained mask. Raises ValueError: a token outside the vocabulary (in
        tokens made while the job runs; the job's own data is checked when it starts)."""
        if start.example is not None:  # made while the job runs (a graded rollout, a driven call's datum)
            device = self.trainer.model.device
            ids = torch.tensor(start.example.token_ids, dtype=torch.int64, device=device)
            check_token_ids(ids, vocab_size)
            return ids, torch.tensor(start.example.trained, dtype=torch.bool, device=device)
        if start.evaluate:
            return (self.validation_rejected if start.rejected else self.validation)[start.example_index]
        return (self.rejected if start.rejected else self.examples)[start.example_index]

    def backward(self, state: SequenceState, layer_start: int, layer_end: int, start: int, end: int) -> None:
        """A backward tasklet: layers [layer_start, layer_end), the highest first, on tokens [start, end).
        Raises RuntimeError: it does not continue a layer's backward (its earlier tokens are not next)."""
        for layer in reversed(range(layer_start, layer_end)):
            if state.backward_end[layer] != end:
                raise RuntimeError(f"a tasklet on tokens [{start}, {end}) does not continue layer {layer} of "
                                   f"its sequence, pending up to {state.backward_end[layer]}")
            self.trainer.backward_tasklet(state, layer, end - start)

    def sequence_done(self, seq: TrainingSequence) -> None:
        """A trained sequence's backward is complete: its loss (a DPO pair's, with its chosen answer) joins
        the batch's."""
        self.batch_loss_sum += seq.state.loss_sum
        if seq.dpo is not None:
            self.batch_pairs.append(seq.dpo)

    def set_mark(self, sequence_id: str) -> None:
        self.mark = GradientMark(sequence_id, snapshot_gradient(self.lora), self.batch_loss_sum,
                                 list(self.batch_pairs))

    def roll_back(self, sequence_id: str) -> None:
        """The gradient and batch sums as they were before `sequence_id` (nothing when that sequence set
        no mark: it never started, so the call added nothing)."""
        if self.mark is not None and self.mark.sequence_id == sequence_id:
            restore_gradient(self.lora, self.mark.gradient)
            self.batch_loss_sum, self.batch_pairs = self.mark.batch_loss_sum, list(self.mark.batch_pairs)


def sequence_loss(spec: LossSpec, start: SequenceStart, device: torch.device) -> TokenLoss | None:
    """The token loss of a sequence: DPO's summed log-probs, a policy-gradient loss over the sequence's
    per-token inputs, or None (cross-entropy on its trained tokens)."""
    if spec.kind == LossKind.DPO:
        return SequenceLogprob()
    if start.inputs is None:
        return None
    return token_loss(spec, start.inputs, device)


@dataclass(slots=True)
class TrainingSequence:
    """One training sequence in flight in the engine."""

    job_id: str
    state: SequenceState
    grad_before: Gradient | None  # the job's .grad when it started (None: forward only)
    pair: PairStart | None = None  # a DPO pair's trained sequence
    dpo: tuple[DpoPair, PairLogprobs] | None = None  # its pair's loss, once both forwards are done
    report_logprobs: bool = False  # its last window reports every token's log-prob


def scale_pair(seq: TrainingSequence, partner: TrainingSequence, beta: float) -> None:
    """Both forwards of a DPO pair are done: scale each sequence's gradient by the pair's coefficient."""
    assert seq.pair is not None
    chosen, rejected = (seq, partner) if seq.pair.chosen else (partner, seq)
    pair = seq.pair
    logprobs = PairLogprobs(chosen.state.loss_sum, rejected.state.loss_sum, pair.reference_chosen,
                            pair.reference_rejected)
    result = dpo_pair(logprobs, beta, pair.pairs_in_batch)
    chosen.state.scale_gradient(result.chosen_coefficient)
    rejected.state.scale_gradient(result.rejected_coefficient)
    chosen.dpo = (result, logprobs)
