"""The engine's side of fine-tuning: each job's trainable adapter, optimizer and sequences, and the
execution of a plan's `TrainingWork` (see `coserve.contract.training_plan` for the contract).

Forward windows do not run here on coserve's engine: it puts them in its fused forward with the
inference tokens (`Engine.step`), asks `window_rows` how to place them and hands the results back
through `keep_layer_input` and `record_windows`. An engine that owns no coserve KV cache nor LoRA bank
(vLLM: `cache` and `bank` None) runs them here instead (`run_windows`: the trainer's own forward, K/V
in the sequence's dense buffers). Everything else (backward tasklets, optimizer steps, saves) runs here
after the forward.

A job's failure (a NaN/inf loss or gradient, an unreadable checkpoint, settings the engine cannot
hold) is reported and the job's state dropped; the engine keeps serving.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coserve.contract.data_position import DataPosition
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.preference import DpoPair, PairLogprobs, dpo_metrics, dpo_pair
from coserve.contract.training_plan import (
    ForwardWindow,
    JobFailure,
    JobStart,
    OptimizerStep,
    PairStart,
    SaveAdapter,
    SavedAdapter,
    SequenceStart,
    StepReport,
    TrainingExample,
    TrainingReport,
    TrainingWork,
    WindowReport,
)
from coserve.forward.kv_cache import KVCache
from coserve.forward.lora import LoRABank
from coserve.forward.transformer import Transformer
from coserve.trainer.checkpoint import save_checkpoint
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.optimizer import LoRAOptimizer, NonFiniteGradientError
from coserve.trainer.setup import build_trainable
from coserve.trainer.token_losses import SequenceLogprob, TokenLoss, token_loss
from coserve.trainer.windowed import SequenceState, WindowedTrainer


class JobError(Exception):
    """A job cannot go on; `code` goes into the job's error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


Tensors = list[tuple[torch.Tensor, torch.Tensor]]  # (token ids, trained mask) per example


@dataclass(slots=True)
class _Job:
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

    def example(self, start: SequenceStart) -> tuple[torch.Tensor, torch.Tensor]:
        if start.example is not None:  # made while the job runs (a graded rollout)
            device = self.trainer.model.device
            return (torch.tensor(start.example.token_ids, dtype=torch.int64, device=device),
                    torch.tensor(start.example.trained, dtype=torch.bool, device=device))
        if start.evaluate:
            return (self.validation_rejected if start.rejected else self.validation)[start.example_index]
        return (self.rejected if start.rejected else self.examples)[start.example_index]


def _sequence_loss(spec: LossSpec, start: SequenceStart, device: torch.device) -> TokenLoss | None:
    """The token loss of a sequence: DPO's summed log-probs, a policy-gradient loss over the sequence's
    per-token inputs, or None (cross-entropy on its trained tokens)."""
    if spec.kind == LossKind.DPO:
        return SequenceLogprob()
    if start.inputs is None:
        return None
    return token_loss(spec, start.inputs, device)


@dataclass(slots=True)
class _Sequence:
    job_id: str
    state: SequenceState
    grad_before: list[torch.Tensor | None] | None  # the job's .grad when it started (None: forward only)
    pair: PairStart | None = None  # a DPO pair's trained sequence
    dpo: tuple[DpoPair, PairLogprobs] | None = None  # its pair's loss, once both forwards are done
    report_logprobs: bool = False  # its last window reports every token's log-prob


@dataclass(slots=True)
class WindowRows:
    """Where a forward window sits in the fused batch."""

    window: ForwardWindow
    slot: int  # bank slot of the job's trainable adapter
    token_ids: list[int]


@dataclass(slots=True)
class TrainingRuntime:
    """Per-engine fine-tuning state, driven by each plan's `TrainingWork`."""

    model: Transformer
    cache: KVCache | None  # None: forward windows run standalone (`run_windows`)
    bank: LoRABank | None  # None: no bank to install the job's adapter in (the trainer keeps it)
    max_lora_rank: int = 0  # the largest rank a job may have, when there is no bank
    jobs: dict[str, _Job] = field(default_factory=dict)
    sequences: dict[str, _Sequence] = field(default_factory=dict)

    # ------------------------------------------------------------------------ before the forward

    def apply_control(self, work: TrainingWork, report: TrainingReport) -> None:
        """Job stops and starts, sequence drops and starts (before the fused forward)."""
        for job_id in work.job_stops:
            self._drop_job(job_id)
        for start in work.job_starts:
            try:
                self.jobs[start.job_id] = self._build_job(start)
            except JobError as err:
                report.failures.append(JobFailure(start.job_id, err.code, str(err)))
                continue
            self._install(start.job_id)
        for sequence_id in work.sequence_drops:
            self._drop_sequence(sequence_id)
        for seq in work.sequence_starts:
            job = self.jobs.get(seq.job_id)
            if job is None:
                continue  # the job failed in this plan; its work is skipped
            ids, trained = job.example(seq)
            forward_only = seq.evaluate or seq.reference
            loss = _sequence_loss(seq.loss or job.loss, seq, ids.device)
            state = job.trainer.start_sequence(ids, trained, seq.loss_normalizer,
                                               paged=self.cache is not None, keep_inputs=not forward_only,
                                               loss=loss, adapter=not seq.reference)
            grads = None if forward_only else [None if p.grad is None else p.grad.clone()
                                               for p in job.lora.parameters()]
            self.sequences[seq.sequence_id] = _Sequence(seq.job_id, state, grads, seq.pair,
                                                        report_logprobs=seq.report_logprobs)

    def _build_job(self, start: JobStart) -> _Job:
        cfg = self.model.cfg
        try:
            lora, optimizer = build_trainable(cfg, self.model.device, start.lora, start.optimizer, start.seed,
                                              start.resume_from, start.init_adapter)
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise JobError("invalid_job", f"cannot set up the job's adapter: {err}") from err
        max_rank = self.max_lora_rank if self.bank is None else self.bank.max_rank
        if lora.config.r > max_rank:
            raise JobError("invalid_job", f"LoRA rank {lora.config.r} is above the engine's "
                           f"max_lora_rank {max_rank}")
        device = self.model.device
        def tensors(examples: list[TrainingExample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(torch.tensor(e.token_ids, dtype=torch.int64, device=device),
                     torch.tensor(e.trained, dtype=torch.bool, device=device)) for e in examples]

        trainer = WindowedTrainer(self.model, lora, cache=self.cache)
        return _Job(lora, optimizer, trainer, start.adapter_slot, tensors(start.examples),
                    tensors(start.validation_examples), start.base_model_name_or_path, start.loss,
                    tensors(start.rejected_examples), tensors(start.validation_rejected))

    def _install(self, job_id: str) -> None:
        """Put the job's current weights into its bank slot (forward windows run through them)."""
        job = self.jobs[job_id]
        if self.bank is None:  # standalone windows use the trainer's snapshot
            job.trainer.refresh_adapter()
            return
        self.bank.install(job.slot, job.lora.adapter_weights(adapter_id=-1, dtype=self.model.dtype))

    def _drop_sequence(self, sequence_id: str) -> None:
        """Forget a sequence and undo its gradient contribution; the scheduler redoes it later."""
        seq = self.sequences.pop(sequence_id, None)
        job = self.jobs.get(seq.job_id) if seq is not None else None
        if seq is None or job is None or seq.grad_before is None:
            return
        for param, before in zip(job.lora.parameters(), seq.grad_before):
            param.grad = before

    def export_adapter(self, slot: int, path: Path) -> str | None:
        """Write the current weights of the job training in bank slot `slot` as a PEFT folder at `path`
        (for an engine that keeps its own copies of adapters: vLLM); returns the job's id, None when no
        job trains in that slot (the newest, should a job that was never stopped still name it)."""
        for job_id, job in reversed(self.jobs.items()):
            if job.slot == slot:
                job.lora.save_pretrained(path, job.base_model_name_or_path)
                return job_id
        return None

    def slot_of(self, job_id: str) -> int | None:
        """The bank slot the job trains in (None: no such job)."""
        job = self.jobs.get(job_id)
        return None if job is None else job.slot

    def _drop_job(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        for sequence_id in [s for s, seq in self.sequences.items() if seq.job_id == job_id]:
            del self.sequences[sequence_id]
        if self.bank is not None:
            installed = self.bank.slots[job.slot]
            if installed is not None and installed.adapter_id == -1:
                self.bank.unload(job.slot)

    def _fail(self, job_id: str, code: str, message: str, report: TrainingReport) -> None:
        self._drop_job(job_id)
        report.failures.append(JobFailure(job_id, code, message))

    # ------------------------------------------------------------------------ the fused forward

    def window_rows(self, work: TrainingWork) -> list[WindowRows]:
        """The forward windows whose job and sequence are alive, with their tokens and slot."""
        rows = []
        for window in work.forward_windows:
            seq = self.sequences.get(window.sequence_id)
            if seq is None:
                continue
            state, end = seq.state, window.start + window.num_tokens
            if window.start != state.forward_end or end > state.length:
                raise RuntimeError(f"window [{window.start}, {end}) of {window.sequence_id} does not "
                                   f"continue its forward at {state.forward_end}")
            kv_slots = state.kv_slots
            # Fused windows only come with the engine's paged cache, and their sequences are paged.
            assert self.cache is not None and kv_slots is not None
            bs = self.cache.block_size
            pos = torch.arange(window.start, end)
            table = torch.tensor(window.block_table, dtype=torch.int64)
            kv_slots[window.start:end] = (table[pos // bs] * bs + pos % bs).to(kv_slots.device)
            token_ids = state.token_ids[window.start:end].tolist()
            slot = self.jobs[seq.job_id].slot if state.adapter else -1  # -1: the base model alone
            rows.append(WindowRows(window, slot, token_ids))
        return rows

    def keep_layer_input(self, placed: list[tuple[int, WindowRows]], layer: int,
                         hidden: torch.Tensor) -> None:
        """Copy each window's rows of layer `layer`'s input into its sequence (the recompute input)."""
        for row, item in placed:
            w = item.window
            kept = self.sequences[w.sequence_id].state.layer_inputs[layer]
            if kept is not None:  # None: an evaluation sequence keeps nothing
                kept[w.start:w.start + w.num_tokens].copy_(hidden[row:row + w.num_tokens])

    def record_windows(self, placed: list[tuple[int, WindowRows]], hidden: torch.Tensor,
                       report: TrainingReport) -> None:
        """Loss and output gradient of each window from its last hidden rows."""
        for row, item in placed:
            w = item.window
            seq = self.sequences.get(w.sequence_id)
            if seq is None:
                continue  # its job failed earlier in this loop
            rows = hidden[row:row + w.num_tokens].clone()  # a normal tensor: autograd may use it
            job = self.jobs[seq.job_id]
            result = job.trainer.record_window(seq.state, w.start, w.start + w.num_tokens, rows)
            self._window_done(w, seq, result.loss_sum, result.num_tokens, report)

    def run_windows(self, work: TrainingWork, report: TrainingReport) -> None:
        """Run the plan's forward windows with the trainer's own forward (an engine without a coserve
        KV cache: each window's K/V stay in its sequence's dense buffers; block tables are unused)."""
        for w in work.forward_windows:
            seq = self.sequences.get(w.sequence_id)
            if seq is None:
                continue  # its job failed or stopped
            if w.start != seq.state.forward_end:
                raise RuntimeError(f"window [{w.start}, {w.start + w.num_tokens}) of {w.sequence_id} does "
                                   f"not continue its forward at {seq.state.forward_end}")
            result = self.jobs[seq.job_id].trainer.forward_window(seq.state, w.num_tokens)
            self._window_done(w, seq, result.loss_sum, result.num_tokens, report)

    def _window_done(self, w: ForwardWindow, seq: _Sequence, loss_sum: float, num_tokens: int,
                     report: TrainingReport) -> None:
        """Report a window's loss; a non-finite loss fails its job; an evaluated sequence is done."""
        if not math.isfinite(loss_sum):
            self._fail(seq.job_id, "non_finite_loss", f"the training loss became "
                       f"{loss_sum} on sequence {w.sequence_id}; the job stopped", report)
            return
        logprobs = None
        if seq.report_logprobs and seq.state.forward_done:
            assert seq.state.logprobs is not None  # set by start_sequence
            logprobs = seq.state.logprobs.tolist()
        report.windows.append(WindowReport(w.sequence_id, loss_sum, num_tokens, logprobs))
        if seq.grad_before is None and seq.state.forward_done:  # forward only: nothing more to do
            del self.sequences[w.sequence_id]
        elif seq.pair is not None and seq.state.forward_done:
            self._scale_pair(seq)

    def _scale_pair(self, seq: _Sequence) -> None:
        """Both forwards of a DPO pair are done: scale each sequence's gradient by the pair's
        coefficient (before either backward: `SequenceState.scale_gradient`)."""
        assert seq.pair is not None
        partner = self.sequences.get(seq.pair.partner_id)
        if partner is None or not partner.state.forward_done:
            return  # the partner's forward finishes later (it scales both then)
        chosen, rejected = (seq, partner) if seq.pair.chosen else (partner, seq)
        pair = seq.pair
        logprobs = PairLogprobs(chosen.state.loss_sum, rejected.state.loss_sum, pair.reference_chosen,
                                pair.reference_rejected)
        result = dpo_pair(logprobs, self.jobs[seq.job_id].loss.beta, pair.pairs_in_batch)
        chosen.state.scale_gradient(result.chosen_coefficient)
        rejected.state.scale_gradient(result.rejected_coefficient)
        chosen.dpo = (result, logprobs)

    # ------------------------------------------------------------------------ after the forward

    def run_after_forward(self, work: TrainingWork, report: TrainingReport) -> None:
        """Backward tasklets, optimizer steps and saves, in that order."""
        for tasklet in work.backward_tasklets:
            seq = self.sequences.get(tasklet.sequence_id)
            if seq is None:
                continue
            trainer = self.jobs[seq.job_id].trainer
            for layer in reversed(range(tasklet.layer_start, tasklet.layer_end)):
                if seq.state.backward_end[layer] != tasklet.end:
                    raise RuntimeError(f"tasklet {tasklet} does not continue layer {layer} of its "
                                       f"sequence, pending up to {seq.state.backward_end[layer]}")
                trainer.backward_tasklet(seq.state, layer, tasklet.end - tasklet.start)
            if seq.state.backward_done:
                self._sequence_done(tasklet.sequence_id)
        for step in work.optimizer_steps:
            if step.job_id in self.jobs:
                self._step(step, report)
        for save in work.saves:
            job = self.jobs.get(save.job_id)
            if job is not None and self._save(job, save, report) and save.final:
                self._drop_job(save.job_id)

    def _sequence_done(self, sequence_id: str) -> None:
        """A trained sequence's backward is complete: its loss (a DPO pair's, with its chosen answer)
        joins the batch's, and its state goes."""
        seq = self.sequences.pop(sequence_id)
        job = self.jobs[seq.job_id]
        job.batch_loss_sum += seq.state.loss_sum
        if seq.dpo is not None:
            job.batch_pairs.append(seq.dpo)

    def _save(self, job: _Job, save: SaveAdapter, report: TrainingReport) -> bool:
        """Write a checkpoint or the final adapter; a failed write (disk full, permissions) fails the job
        with the reason, never the iteration: the requests batched with it are not the job's fault.
        A checkpoint is written atomically (the previous one stays); a partial final adapter is removed."""
        path = Path(save.path)
        try:
            if save.position is None:
                job.lora.save_pretrained(path, job.base_model_name_or_path)
            else:
                save_checkpoint(path, job.lora, job.optimizer, DataPosition.from_dict(save.position),
                                job.base_model_name_or_path, save.trained_tokens, save.reference_logprobs)
        except OSError as err:
            if save.position is None:
                shutil.rmtree(path, ignore_errors=True)
            what = "the fine-tuned adapter" if save.position is None else f"the checkpoint of step {save.step}"
            self._fail(save.job_id, "checkpoint_write_failed", f"could not write {what}: "
                       f"{err.strerror or err}; the job stopped (its last checkpoint is kept)", report)
            return False
        report.saved.append(SavedAdapter(save.job_id, str(path), save.step))
        return True

    def _step(self, planned: OptimizerStep, report: TrainingReport) -> None:
        job_id, step, num_sequences = planned.job_id, planned.step, planned.num_sequences
        num_tokens = planned.num_tokens
        job = self.jobs[job_id]
        if step != job.optimizer.step_count + 1:
            raise RuntimeError(f"job {job_id}: plan asks for step {step}, the optimizer has done "
                               f"{job.optimizer.step_count}")
        loss, metrics = job.batch_loss_sum / num_tokens, {}
        if job.batch_pairs:
            pairs, logprobs = zip(*job.batch_pairs, strict=True)
            metrics = dpo_metrics(list(pairs), list(logprobs)).as_dict()
            loss = metrics["train_loss"]
        try:
            stats = job.optimizer.step(loss=loss, num_sequences=num_sequences, num_tokens=num_tokens,
                                       adam=planned.adam)
        except NonFiniteGradientError as err:
            self._fail(job_id, "non_finite_gradient", f"{err}; the job stopped", report)
            return
        job.batch_loss_sum, job.batch_pairs = 0.0, []
        self._install(job_id)
        report.steps.append(StepReport(job_id, stats.step, loss, stats.grad_norm, stats.learning_rate,
                                       num_sequences, num_tokens, metrics))
