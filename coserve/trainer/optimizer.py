"""AdamW over a trainable LoRA's fp32 master weights: batch accumulation, clipping, one step.

One optimizer step of a fine-tuning job (issue 3, item 4):

1. Every sequence of the batch runs its forward windows and backward tasklets with
   `loss_normalizer` = the trained tokens of the *whole batch*, so the LoRA `.grad` summed over the
   batch is the gradient of (sum of the batch's token losses) / (batch's trained tokens), whatever
   the windowing (see `windowed.py`).
2. The gradient is clipped to a total L2 norm of `max_grad_norm` (1.0), with exactly
   `torch.nn.utils.clip_grad_norm_`'s arithmetic (it is `get_total_norm` + `clip_grads_with_norm_`,
   which we call separately so a non-finite norm fails *before* anything is scaled or stepped).
3. `torch.optim.AdamW` steps the fp32 master tensors, so the update equals peft + AdamW's bit for bit
   up to the gradient's own rounding; the base model may run in bf16, the optimizer never does.

Hyperparameters: learning rate = 1e-4 x `learning_rate_multiplier` (the issue's rule). Weight decay
defaults to 0.0, not `torch.optim.AdamW`'s 0.01: HF `TrainingArguments` (the usual peft recipe) and
OpenAI's fine-tuning API expose no decay by default, and decay on LoRA's B pulls it towards the
zero init, i.e. towards the base model, which a user did not ask for. Betas and eps are AdamW's.

The scheduler drives steps piecewise (tasklets of many sequences interleaved with inference) and
calls `LoRAOptimizer.step` when the batch's last backward tasklet completes; `train_batch` is the
same thing in one call for offline use and tests. After every step the trainer's forward snapshot
must be refreshed (`WindowedTrainer.refresh_adapter`), which `train_batch` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from coserve.contract.training_settings import AdamStep, OptimizerSettings
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.windowed import WindowedTrainer, train_sequence

STATE_FORMAT = 1  # version of `LoRAOptimizer.state_dict`'s layout


class NonFiniteGradientError(FloatingPointError):
    """The batch's loss or gradient norm is NaN/inf; the job must fail, the weights are untouched.
    `loss` is the batch loss the step was given (None: not given)."""

    def __init__(self, message: str, loss: float | None = None) -> None:
        super().__init__(message)
        self.loss = loss

    @property
    def code(self) -> str:
        """The job's error code: `non_finite_loss` when the loss itself is NaN/inf."""
        return "non_finite_loss" if self.loss is not None and not math.isfinite(self.loss) \
            else "non_finite_gradient"


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one optimizer step did, for logs, job events and the latency model."""

    step: int  # optimizer steps done, this one included
    grad_norm: float  # total L2 norm of the batch gradient before clipping
    clipped: bool  # the gradient was scaled down to max_grad_norm
    learning_rate: float
    loss: float | None = None  # the batch's mean token loss, when the caller knows it
    num_sequences: int = 0
    num_tokens: int = 0  # trained tokens of the batch (the loss normaliser)


class LoRAOptimizer:
    """AdamW over `lora.parameters()` with clipping; the state saves and restores exactly.

    Parameter order is `TrainableLoRA.parameters()`'s canonical order (layer, then module, A then B),
    which `TrainableLoRA.from_pretrained` restores, so a saved AdamW state maps onto a reloaded
    adapter tensor for tensor.
    """

    def __init__(self, lora: TrainableLoRA, config: OptimizerSettings | None = None) -> None:
        self.lora = lora
        self.config = config or OptimizerSettings()
        self.params = lora.parameters()
        # Defaults for foreach/fused, as the peft reference gets: same kernels, same rounding.
        self._adamw = torch.optim.AdamW(self.params, lr=self.config.learning_rate,
                                        betas=self.config.betas, eps=self.config.eps,
                                        weight_decay=self.config.weight_decay)
        self.step_count = 0

    @property
    def num_elements(self) -> int:
        """Elements a step reads and writes: the latency model's cost of a step (a few passes each)."""
        return sum(p.numel() for p in self.params)

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (set to None, so the next batch starts from nothing)."""
        self.lora.zero_grad()

    def state_tensors(self) -> list[dict[str, Any]]:
        """AdamW's state of each parameter that has one (its moments and step), to move with it."""
        return [self._adamw.state[p] for p in self.params if p in self._adamw.state]

    def step(self, loss: float | None = None, num_sequences: int = 0,
             num_tokens: int = 0, adam: AdamStep | None = None) -> StepStats:
        """Clip the accumulated gradient to `max_grad_norm`, take one AdamW step, clear the grads.

        `adam`: this step's own hyperparameters (a driven run's client sends them with each step); they
        stay the optimizer's until the next step that brings its own.

        Raises:
            RuntimeError: no gradient was accumulated.
            NonFiniteGradientError: the gradient norm (or the given loss) is NaN/inf; the weights
                and the AdamW state are left as they were and the gradients are dropped.
        """
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            raise RuntimeError("optimizer step without any accumulated gradient")
        total = get_total_norm(grads, norm_type=2.0)
        norm = float(total)
        if not math.isfinite(norm) or (loss is not None and not math.isfinite(loss)):
            self.zero_grad()
            raise NonFiniteGradientError(f"non-finite training signal at step {self.step_count + 1}:"
                                         f" loss={loss}, gradient norm={norm}", loss)
        max_norm = self.config.max_grad_norm if adam is None else adam.max_grad_norm
        if adam is not None:
            for group in self._adamw.param_groups:
                group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                             weight_decay=adam.weight_decay)
        clip_grads_with_norm_(self.params, max_norm, total)
        self._adamw.step()
        self.zero_grad()
        self.step_count += 1
        # clip_grads_with_norm_ scales by min(1, max_norm / (norm + 1e-6)): report that condition.
        clipped = max_norm / (norm + 1e-6) < 1.0
        return StepStats(step=self.step_count, grad_norm=norm, clipped=clipped,
                         learning_rate=float(self._adamw.param_groups[0]["lr"]), loss=loss,
                         num_sequences=num_sequences, num_tokens=num_tokens)

    def state_dict(self) -> dict[str, Any]:
        """Settings, step count and AdamW's state (tensors: exp_avg, exp_avg_sq, step).

        Like `torch.optim.Optimizer.state_dict`, the tensors are the live ones, not copies: save them
        (`torch.save`) or deep-copy them before the next step.
        """
        return {"format": STATE_FORMAT, "config": self.config.to_dict(),
                "step_count": self.step_count, "adamw": self._adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` taken from an optimizer over an adapter of the same shapes.

        Raises:
            ValueError: another format, other settings, or moment tensors that do not fit the adapter.
        """
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"optimizer state format {state.get('format')!r}, expected {STATE_FORMAT}")
        saved = OptimizerSettings.from_dict(state["config"])
        if saved != self.config:
            raise ValueError(f"optimizer state was saved with {saved}, this optimizer has {self.config}")
        adamw = state["adamw"]
        for index, per_param in adamw["state"].items():
            index = int(index)
            shape = tuple(self.params[index].shape) if index < len(self.params) else None
            if shape is None or any(tuple(t.shape) != shape for k, t in per_param.items()
                                    if k != "step"):
                raise ValueError(f"optimizer state of parameter {index} does not fit the adapter "
                                 f"(expected shape {shape})")
        self._adamw.load_state_dict(adamw)
        self.step_count = int(state["step_count"])

    @classmethod
    def from_state_dict(cls, lora: TrainableLoRA, state: dict[str, Any]) -> LoRAOptimizer:
        """An optimizer over `lora` with the saved settings and state."""
        optimizer = cls(lora, OptimizerSettings.from_dict(state["config"]))
        optimizer.load_state_dict(state)
        return optimizer


@dataclass(frozen=True, slots=True)
class TrainingSequence:
    """One tokenized example and how to window it (None: one forward window, backward reversed)."""

    token_ids: torch.Tensor  # [L]
    trained: torch.Tensor  # [L] bool: token p is learned (an assistant token)
    forward_windows: list[int] | None = None
    backward_windows: list[int] | None = None

    @property
    def num_trained(self) -> int:
        """Positions with a target: token p is the target of p - 1, so token 0 never counts."""
        return int(torch.as_tensor(self.trained)[1:].sum())


class GradientSync(Protocol):
    """Data parallelism for `train_batch`: the part of a batch this process trains, and the sum over
    every process of the gradients and the loss (DDP's all-reduce); `data_parallel.ProcessGroupSync`."""

    def shard(self, batch: list[TrainingSequence]) -> list[TrainingSequence]: ...

    def all_reduce(self, params: list[torch.Tensor], loss_sum: float) -> float:
        """Sum every process's `.grad` into each of `params` (None where no process has one) and
        return the summed loss."""


def train_batch(trainer: WindowedTrainer, optimizer: LoRAOptimizer,
                batch: list[TrainingSequence], sync: GradientSync | None = None) -> StepStats:
    """Accumulate the batch-mean gradient over `batch`, take one optimizer step, refresh the trainer.

    Sequences without a trained token add nothing to the loss or the gradient and are skipped (the
    job counts them). Raises ValueError when the whole batch has no trained token, and
    NonFiniteGradientError (weights untouched) on a NaN/inf loss or gradient.

    With `sync`, this process trains only its shard of the batch (still normalised by the whole
    batch's trained tokens), and the gradients and loss are summed over the processes before the
    step: every process then takes the same step as one process training the whole batch.
    """
    if trainer.lora is not optimizer.lora:
        raise ValueError("the trainer and the optimizer must share one TrainableLoRA")
    live = [seq for seq in batch if seq.num_trained > 0]
    total = sum(seq.num_trained for seq in live)
    if total == 0:
        raise ValueError(f"a batch of {len(batch)} sequences with no trained token")
    optimizer.zero_grad()  # a batch owns its accumulation: never inherit a stale gradient
    loss_sum = 0.0
    for seq in live if sync is None else sync.shard(live):
        windows = seq.forward_windows or [int(seq.token_ids.numel())]
        state = train_sequence(trainer, seq.token_ids, seq.trained, windows, seq.backward_windows,
                               loss_normalizer=total)
        loss_sum += state.loss_sum
    if sync is not None:
        loss_sum = sync.all_reduce(optimizer.params, loss_sum)
    stats = optimizer.step(loss=loss_sum / total, num_sequences=len(live), num_tokens=total)
    trainer.refresh_adapter()  # forward windows of the next batch must see the new weights
    return stats
