"""The engine's side of fine-tuning: each job's trainable adapter, optimizer and sequences, and the
execution of a plan's `TrainingWork` (see `coserve.contract.training_plan` for the contract).

Forward windows do not run here on coserve's engine: it puts them in its fused forward with the
inference tokens (`Engine.step`), asks `window_rows` how to place them and hands the results back
through `keep_layer_input` and `record_windows`. An engine that owns no coserve KV cache nor LoRA bank
(vLLM: `cache` and `bank` None) runs them here instead (`run_windows`: the trainer's own forward, K/V
in the sequence's dense buffers). Everything else (backward tasklets, optimizer steps, saves) runs here
after the forward.

A job's failure (a NaN/inf loss or gradient, an unreadable checkpoint, settings or data the engine
cannot hold, an error in its optimizer step or save) is reported and the job's state dropped; the engine
keeps serving. An error in one sequence's work (its tokens, a window, a tasklet) is reported as a
`JobFault` and only that sequence is dropped, its gradient restored (`job_state`): nothing of another
job's or request's work in the step is touched. What stays shared is the fused forward
(`keep_layer_input`): an error there is the engine's to report (`PlanFault`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from coserve.contract.engine import fault_text
from coserve.contract.training_plan import (
    ForwardWindow,
    JobFailure,
    JobFault,
    JobStart,
    OptimizerStep,
    SaveAdapter,
    SequenceStart,
    TrainingExample,
    TrainingReport,
    TrainingWork,
    WindowReport,
    sequence_job,
)
from coserve.forward.kv_cache import KVCache
from coserve.forward.lora import LoRABank
from coserve.forward.transformer import Transformer
from coserve.trainer.job_state import (
    JobError,
    TrainingJobState,
    TrainingSequence,
    check_token_ids,
    restore_gradient,
    scale_pair,
    sequence_loss,
    snapshot_gradient,
)
from coserve.trainer.job_steps import optimizer_step, save_adapter
from coserve.trainer.optimizer import NonFiniteGradientError
from coserve.trainer.parking import park_job, unpark_job
from coserve.trainer.setup import build_trainable
from coserve.trainer.windowed import WindowedTrainer


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
    jobs: dict[str, TrainingJobState] = field(default_factory=dict)
    sequences: dict[str, TrainingSequence] = field(default_factory=dict)
    parked: dict[str, TrainingJobState] = field(default_factory=dict)  # in host memory, no slot (`parking`)

    # ------------------------------------------------------------------------ before the forward

    def apply_control(self, work: TrainingWork, report: TrainingReport) -> None:
        """Job stops and starts, gradient rollbacks, sequence drops and starts (before the fused forward).
        A job that cannot start fails (`JobFailure`); a sequence that cannot start is that job's fault.
        Idle jobs park first, then parked ones come back (maybe into a slot just given back: `parking`)."""
        for job_id in work.job_parks:
            park_job(self.jobs, self.parked, job_id, self._drop_job)
        for unpark in work.job_unparks:
            if unpark_job(self.jobs, self.parked, unpark, self.model.device):
                self._install(unpark.job_id)
        for job_id in work.job_stops:
            self._drop_job(job_id)
        for start in work.job_starts:
            try:
                self.jobs[start.job_id] = self._build_job(start)
                self._install(start.job_id)
            except JobError as err:
                self._fail(start.job_id, err.code, str(err), report)
            except Exception as err:  # noqa: BLE001 - this job's alone: the step goes on without it
                self._fail(start.job_id, "engine_error", f"the engine could not start the job: "
                           f"{fault_text(err)}", report)
        for sequence_id in work.gradient_rollbacks:
            self._roll_back(sequence_id)
        for sequence_id in work.sequence_drops:
            self._drop_sequence(sequence_id)
        for seq in work.sequence_starts:
            job = self.jobs.get(seq.job_id)
            if job is None:
                continue  # the job failed in this plan; its work is skipped
            try:
                self._start_sequence(job, seq)
            except Exception as err:  # noqa: BLE001 - this job's alone (its tokens, its loss inputs)
                self._fault(seq.job_id, seq.sequence_id, err, report)

    def _start_sequence(self, job: TrainingJobState, seq: SequenceStart) -> None:
        ids, trained = job.example(seq, self.model.cfg.vocab_size)
        forward_only = seq.evaluate or seq.reference
        loss = sequence_loss(seq.loss or job.loss, seq, ids.device)
        state = job.trainer.start_sequence(ids, trained, seq.loss_normalizer,
                                           paged=self.cache is not None, keep_inputs=not forward_only,
                                           loss=loss, adapter=not seq.reference)
        if seq.marks_gradient:
            job.set_mark(seq.sequence_id)
        grads = None if forward_only else snapshot_gradient(job.lora)
        self.sequences[seq.sequence_id] = TrainingSequence(seq.job_id, state, grads, seq.pair,
                                                           report_logprobs=seq.report_logprobs)

    def _build_job(self, start: JobStart) -> TrainingJobState:
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
            pairs = [(torch.tensor(e.token_ids, dtype=torch.int64, device=device),
                      torch.tensor(e.trained, dtype=torch.bool, device=device)) for e in examples]
            for ids, _ in pairs:
                try:
                    check_token_ids(ids, cfg.vocab_size)
                except ValueError as err:
                    raise JobError("invalid_job", f"the job's data cannot be trained: {err}") from err
            return pairs

        trainer = WindowedTrainer(self.model, lora, cache=self.cache)
        return TrainingJobState(lora, optimizer, trainer, start.adapter_slot, tensors(start.examples),
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
        restore_gradient(job.lora, seq.grad_before)

    def _roll_back(self, first: str) -> None:
        """A driven call that starts with sequence `first` failed: drop its job's sequences and put the
        job's gradient back as it was before `first`."""
        job_id = sequence_job(first)
        job = self.jobs.get(job_id)
        if job is None:
            return
        for sequence_id in [s for s, seq in self.sequences.items() if seq.job_id == job_id]:
            del self.sequences[sequence_id]
        job.roll_back(first)

    def _fault(self, job_id: str, sequence_id: str, error: BaseException, report: TrainingReport) -> None:
        """An error in one sequence's work: drop the sequence (its gradient restored) and report it."""
        self._drop_sequence(sequence_id)
        report.faults.append(JobFault(job_id, sequence_id, fault_text(error)))

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
        self.parked.pop(job_id, None)
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

    def window_rows(self, work: TrainingWork, report: TrainingReport) -> list[WindowRows]:
        """The forward windows whose job and sequence are alive, with their tokens and slot; a window that
        does not continue its sequence's forward is that job's fault (the sequence is dropped)."""
        rows = []
        for window in work.forward_windows:
            seq = self.sequences.get(window.sequence_id)
            if seq is None:
                continue
            state, end = seq.state, window.start + window.num_tokens
            if window.start != state.forward_end or end > state.length:
                self._fault(seq.job_id, window.sequence_id, RuntimeError(
                    f"window [{window.start}, {end}) does not continue the sequence's forward at "
                    f"{state.forward_end}"), report)
                continue
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
            try:
                rows = hidden[row:row + w.num_tokens].clone()  # a normal tensor: autograd may use it
                job = self.jobs[seq.job_id]
                result = job.trainer.record_window(seq.state, w.start, w.start + w.num_tokens, rows)
                self._window_done(w, seq, result.loss_sum, result.num_tokens, report)
            except Exception as err:  # noqa: BLE001 - this job's alone: the other windows go on
                self._fault(seq.job_id, w.sequence_id, err, report)

    def run_windows(self, work: TrainingWork, report: TrainingReport) -> None:
        """Run the plan's forward windows with the trainer's own forward (an engine without a coserve
        KV cache: each window's K/V stay in its sequence's dense buffers; block tables are unused)."""
        for w in work.forward_windows:
            seq = self.sequences.get(w.sequence_id)
            if seq is None:
                continue  # its job failed or stopped
            try:
                if w.start != seq.state.forward_end:
                    raise RuntimeError(f"window [{w.start}, {w.start + w.num_tokens}) does not continue the "
                                       f"sequence's forward at {seq.state.forward_end}")
                result = self.jobs[seq.job_id].trainer.forward_window(seq.state, w.num_tokens)
                self._window_done(w, seq, result.loss_sum, result.num_tokens, report)
            except Exception as err:  # noqa: BLE001 - this job's alone: the other windows go on
                self._fault(seq.job_id, w.sequence_id, err, report)

    def _window_done(self, w: ForwardWindow, seq: TrainingSequence, loss_sum: float, num_tokens: int,
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

    def _scale_pair(self, seq: TrainingSequence) -> None:
        """Both forwards of a DPO pair are done: scale each sequence's gradient by the pair's
        coefficient (before either backward: `SequenceState.scale_gradient`)."""
        assert seq.pair is not None
        partner = self.sequences.get(seq.pair.partner_id)
        if partner is not None and partner.state.forward_done:  # else it finishes later (and scales both)
            scale_pair(seq, partner, self.jobs[seq.job_id].loss.beta)

    # ------------------------------------------------------------------------ after the forward

    def run_after_forward(self, work: TrainingWork, report: TrainingReport) -> None:
        """Backward tasklets, optimizer steps and saves, in that order. An error in a tasklet is its
        sequence's (`_fault`); in an optimizer step or a save, the job's (it fails)."""
        for tasklet in work.backward_tasklets:
            seq = self.sequences.get(tasklet.sequence_id)
            if seq is None:
                continue
            try:
                self.jobs[seq.job_id].backward(seq.state, tasklet.layer_start, tasklet.layer_end,
                                               tasklet.start, tasklet.end)
            except Exception as err:  # noqa: BLE001 - this job's alone: the other tasklets go on
                self._fault(seq.job_id, tasklet.sequence_id, err, report)
                continue
            if seq.state.backward_done:
                self._sequence_done(tasklet.sequence_id)
        faulted = {f.job_id for f in report.faults}  # their steps and saves wait: the scheduler ends them
        for step in work.optimizer_steps:
            if step.job_id in self.jobs and step.job_id not in faulted:
                self._guarded(step.job_id, "optimizer step", report, partial(self._step, step, report))
        for save in work.saves:
            job = self.jobs.get(save.job_id)
            if job is None or save.job_id in faulted:
                continue
            if self._guarded(save.job_id, "save", report, partial(self._save, job, save, report)) and save.final:
                self._drop_job(save.job_id)

    def _guarded(self, job_id: str, what: str, report: TrainingReport, run: Callable[[], bool | None]) -> bool:
        """Run a job's optimizer step or save; an unexpected error fails the job (its weights may be half
        written), not the step. Returns what `run` did (False on an error)."""
        try:
            return run() is not False
        except Exception as err:  # noqa: BLE001 - this job's alone: the others' work goes on
            self._fail(job_id, "engine_error", f"the engine failed in the job's {what}: {fault_text(err)}; "
                       "the job stopped (its last checkpoint is kept)", report)
            return False

    def _sequence_done(self, sequence_id: str) -> None:
        """A trained sequence's backward is complete: its loss joins the batch's, and its state goes."""
        seq = self.sequences.pop(sequence_id)
        self.jobs[seq.job_id].sequence_done(seq)

    def _save(self, job: TrainingJobState, save: SaveAdapter, report: TrainingReport) -> bool:
        """Write a checkpoint or the final adapter; a failed write (disk full, permissions) fails the job
        with the reason, never the iteration: the requests batched with it are not the job's fault."""
        try:
            report.saved.append(save_adapter(job, save))
            return True
        except OSError as err:
            what = "the fine-tuned adapter" if save.position is None else f"the checkpoint of step {save.step}"
            self._fail(save.job_id, "checkpoint_write_failed", f"could not write {what}: "
                       f"{err.strerror or err}; the job stopped (its last checkpoint is kept)", report)
            return False

    def _step(self, planned: OptimizerStep, report: TrainingReport) -> None:
        try:
            report.steps.append(optimizer_step(self.jobs[planned.job_id], planned))
        except NonFiniteGradientError as err:
            self._fail(planned.job_id, "non_finite_gradient", f"{err}; the job stopped", report)
            return
        self._install(planned.job_id)
