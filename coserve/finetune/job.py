"""One fine-tuning job as the scheduler sees it: data order, batches, sequences, and the work they need.

A job is broken down as: epochs -> batches (`batch_size` examples, `DataPosition.next_batch`) ->
sequences (one per example, trained one after the other so a job holds the K/V and kept activations
of one sequence at a time) -> forward windows, then backward tasklets (layer-major: last layer first,
last tokens first, any sizes) -> one optimizer step per batch -> a checkpoint at each epoch's end and
the final adapter after the last epoch.

The policy asks a job for work with a budget (`schedule`): forward-window tokens or backward
token-layers, whichever phase the job is in. The job appends its work to `plan.training`, allocates
the KV blocks of its sequence, and returns the fine-tuning tokens to charge to its tenant's virtual
token counter:

* a forward-window token costs 1;
* a backward tasklet of t tokens over k layers costs t * k / num_layers (`backward_tasklet_tokens`):
  a whole sequence of L tokens is charged L for its forward and L for its backward.

When inference needs KV blocks, `release_kv` drops the sequence in flight (the engine restores the
gradient it had before the sequence and frees the kept activations; the sequence is redone later), until
the same sequence was dropped `sequence_kv.MAX_DROPS` times in a row: then it keeps its blocks. The
watchdog's progress marker counts work that stays done (`kept_progress`), not work planned.
A DPO job's batches (reference passes, pairs): `preference_batches`; a reinforcement job's (its graded
rollouts, fed by its driver): `rollout_batches`; validation passes: `validation_pass`; a run driven by
its client's calls (forward_backward, optim_step, saves, loads): `driven_ops`.
Pure Python: no torch, no Ray. The job's spec, states and events are in `coserve.contract.job_spec`.
"""

from __future__ import annotations

import dataclasses

from coserve.contract.data_position import DataPosition
from coserve.contract.job_runner import SequenceRestarts
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind, JobPhase, JobState, trained_tokens
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.sampling import AdapterRef
from coserve.contract.training_calls import CallFailure, ForwardBackwardCall, OptimStepCall, SaveCall
from coserve.contract.training_plan import (
    ForwardWindow,
    JobStart,
    JobUnpark,
    OptimizerStep,
    SaveAdapter,
    SequenceStart,
    TrainingExample,
    sequence_job,
)
from coserve.finetune.driven_ops import DrivenOps, ResolvedLoad
from coserve.finetune.kept_progress import KeptProgress
from coserve.finetune.preference_batches import ReferenceSums, pair_start, preference_batch
from coserve.finetune.progress import BatchProgress, SequenceProgress, supervised_batch
from coserve.finetune.rollout_batches import FedBatch, fed_batch_progress
from coserve.finetune.run_parking import RunParking
from coserve.finetune.sequence_kv import SequenceKV
from coserve.finetune.validation_pass import ValidationPass
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.tenancy.vtc import backward_tasklet_tokens

__all__ = ["FinetuneJob", "FinetuneJobSpec", "JobEvent", "JobEventKind", "JobPhase", "JobState",
           "trained_tokens"]


class FinetuneJob:
    """The scheduler's state of one job; see the module docstring.

    Args:
        spec: the job.
        kv: the KV block manager of the engine the job trains on (its sequences' blocks).
        adapters: that engine's adapter slots (the job pins one for its trainable adapter).
    """

    def __init__(self, spec: FinetuneJobSpec, kv: KVBlockManager, adapters: AdapterSlots) -> None:
        self.spec = spec
        self._kv, self._adapters = SequenceKV(kv), adapters
        self.state = JobState.RUNNING
        self.position = spec.start_position or DataPosition(seed=spec.seed)
        self._slot: int | None = None
        self._started = False  # JobStart sent
        self._batch: BatchProgress | None = None
        self._stop_sent = False
        self._last_planned = -1  # step id of the last plan this job put work into
        # Trained tokens of completed optimizer steps, from the checkpoint's count on a resume (so the
        # job's count continues); and of the steps planned so far, which a checkpoint keeps.
        self.trained_tokens = spec.start_trained_tokens
        self._planned_tokens = spec.start_trained_tokens
        self._validation = ValidationPass(spec)
        self._pending: list[JobEvent] = []  # events found while planning, reported by `update`
        self._references = ReferenceSums(dict(spec.reference_logprobs))  # a DPO job's reference sums
        self._fed: list[FedBatch] = []  # a reinforcement job's graded batches, not started yet
        self._step_metrics: dict[int, dict[str, float]] = {}  # their rewards, for their steps' events
        self.hold_finish = False  # a reinforcement job's final evaluation is still sampling its weights
        self._progress = KeptProgress()  # the watchdog's marker
        self._failure: tuple[str, str] | None = None  # (code, message) to fail with in the next plan
        self._rollback: str | None = None  # a failed call's first sequence: its gradient is put back next plan
        start_step = spec.start_position.step if spec.start_position is not None else 0
        # A run driven by its client's calls (`driven_ops`); None: a job with data of its own.
        self.driven = DrivenOps(spec.job_id, spec.output_dir, spec.num_layers, start_step) if spec.driven else None
        self.parking = RunParking(adapters) if spec.driven else None  # a driven run's slot between its calls
        self.slot_wait: str | None = None  # why its last attempt to take an adapter slot failed (None: it did not)

    # ------------------------------------------------------------------------------ properties

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def tenant(self) -> str:
        return self.spec.tenant

    @property
    def total_steps(self) -> int:
        per_epoch = -(-len(self.spec.examples) // self.spec.batch_size)
        return per_epoch * self.spec.n_epochs

    @property
    def last_planned_step(self) -> int:
        """Step id of the last plan this job put work into (-1: none yet)."""
        return self._last_planned

    @property
    def progress_marker(self) -> int:
        """Grows with work that stays done (`kept_progress`) and a reinforcement job's rollouts."""
        return self._progress.total

    def note_rollout_progress(self, amount: int) -> None:
        self._progress.add(amount)

    @property
    def sequence_restarts(self) -> SequenceRestarts:
        """Its sequences that KV reclaim dropped `MAX_DROPS` times in a row (they then kept their blocks)."""
        return SequenceRestarts(self._kv.kept, self._kv.kept_tokens)

    @property
    def kv_reserve(self) -> int:
        """Free KV blocks inference's admissions must leave for its kept sequence (`sequence_kv`)."""
        batch = self._batch
        return self._kv.reserve(batch.in_flight()) if self._kv.holding and batch is not None and self.runnable else 0

    @property
    def layer_tokens(self) -> tuple[int, int]:
        """Backward tokens left in the layer whose tasklets come next, and in a whole layer ((0, 0)
        outside the backward phase)."""
        seq = self._current()
        return (seq.layer_end[seq.layer], seq.length) if seq is not None and self.phase is JobPhase.BACKWARD else (0, 0)

    @property
    def between_steps(self) -> bool:
        """Started, with no batch in flight or fed: the engine holds the weights of `position.step`."""
        return self._started and self._batch is None and not self._fed

    @property
    def needs_rollouts(self) -> bool:
        """A running reinforcement job between steps: its next batch is to be sampled (from `position`,
        after the last step's weights are in the engine)."""
        return self.spec.is_reinforcement and self.runnable and self.between_steps \
            and self.position.epoch < self.spec.n_epochs and self._failure is None

    def feed(self, batch: FedBatch) -> None:
        """Queue a reinforcement job's graded batch (`rollout_batches`)."""
        self._fed.append(batch)

    @property
    def runnable(self) -> bool:
        """Whether the job has work to schedule (it is running and not waiting for its final save)."""
        return self.state == JobState.RUNNING

    @property
    def has_work(self) -> bool:
        """Runnable, and not a driven run without a call to do (an engine with only those sleeps)."""
        idle = self.driven is not None and self.driven.idle and self._batch is None
        return self.runnable and not idle

    @property
    def phase(self) -> JobPhase:
        seq = self._current()
        if seq is not None and self._forward_target(seq) is None:
            return JobPhase.BACKWARD
        return JobPhase.FORWARD

    def _forward_target(self, seq: SequenceProgress) -> SequenceProgress | None:
        """The sequence whose forward comes next while `seq` is current: `seq` itself, or (a DPO pair)
        the next of its group whose forward is not done; None when the group's forwards are all done."""
        assert self._batch is not None
        if seq.forward_end < seq.length or self._batch.forward_only(seq):
            return seq if seq.forward_end < seq.length else None
        return next((s for s in self._batch.group_of(seq) if s.forward_end < s.length), None)

    def _current(self) -> SequenceProgress | None:
        if self._batch is None or self._batch.current >= len(self._batch.sequences):
            return None
        return self._batch.sequences[self._batch.current]

    # ------------------------------------------------------------------------------ life cycle

    def pause(self, plan: IterationPlan) -> None:
        """Stop taking work; the sequence in flight is dropped (redone on resume)."""
        if self.state == JobState.RUNNING:
            self.release_kv(plan)
            self.state = JobState.PAUSED

    def resume(self) -> None:
        if self.state == JobState.PAUSED:
            self.state = JobState.RUNNING

    def cancel(self, plan: IterationPlan) -> JobEvent | None:
        """Cancel now: the engine drops the job; returns the event (None if already finished)."""
        if self.state.is_finished:
            return None
        self._end(plan, JobState.CANCELLED)
        return JobEvent(self.job_id, JobEventKind.CANCELLED, self.position.step,
                        message="the job was cancelled")

    def fail(self, code: str, message: str) -> None:
        """Fail the job in its next plan (`apply_failure`: the engine drops it there); its checkpoints stay."""
        if not self.state.is_finished and self._failure is None:
            self._failure = (code, message)

    def fault(self, message: str, own: bool = True) -> None:
        """Its work in a plan could not run (a `JobFault`: `own`, its own error; or a plan that failed
        whole, a generic one): a driven run's call fails with `message` and the run goes on (a
        `forward_backward`'s gradient is put back in the next plan, `apply_failure`); any other job fails
        in its next plan."""
        if self.state.is_finished:
            return
        driven = self.driven
        failed = driven.fail_current(message, own) if driven is not None else None
        if failed is None:
            self.fail("engine_error", f"the engine could not run the job's work: {message}")
            return
        self._kv.free_all(self._current())
        self._batch = None
        self._rollback = failed or None

    def apply_failure(self, plan: IterationPlan) -> JobEvent | None:
        """End a job `fail` was called on; returns its event (None: no failure asked). A driven run whose
        call failed has its gradient put back here (`fault`)."""
        if self._rollback is not None and not self.state.is_finished:
            plan.training.gradient_rollbacks.append(self._rollback)
            self._rollback = None
        if self._failure is None or self.state.is_finished:
            return None
        code, message = self._failure
        self._end(plan, JobState.FAILED)
        return JobEvent(self.job_id, JobEventKind.FAILED, self.position.step, code=code, message=message)

    def _end(self, plan: IterationPlan | None, state: JobState) -> None:
        """Release every resource; with a plan, tell the engine to drop the job's state."""
        self.state = state
        self._kv.free_all(self._current())
        if self._slot is not None:
            # The trainable weights die with the job (the engine unloads them): free the slot.
            self._adapters.release(self.spec.adapter_id)
            if self._adapters.pin_count(self.spec.adapter_id) == 0:
                self._adapters.forget(self.spec.adapter_id)
            self._slot = None
        if plan is not None and self._started and not self._stop_sent:
            plan.training.job_stops.append(self.job_id)
            self._stop_sent = True
        if self.driven is not None:
            self.driven.fail_all(CallFailure("run_ended", f"the training run ended ({state.value})", user=False))

    def settle(self, plan: IterationPlan) -> None:
        """A driven run between its calls gives its slot back when something waits for one, or after a while
        (`run_parking`); the engine keeps its state in host memory."""
        parking, driven = self.parking, self.driven
        if parking is None or driven is None or self._slot is None or not self._started or self.state.is_finished:
            return
        rolling_back = any(sequence_job(s) == self.job_id for s in plan.training.gradient_rollbacks)
        if parking.should_park(driven.idle and self._batch is None and self._rollback is None and not rolling_back):
            self._adapters.release(self.spec.adapter_id)
            self._adapters.forget(self.spec.adapter_id)
            self._slot, parking.parked = None, True
            plan.training.job_parks.append(self.job_id)

    @property
    def claims_slot(self) -> bool:
        """Whether it counts against its engine's adapter slots when jobs are placed: a job does; a driven
        run only while it holds one for a call (an idle one gives its slot to whoever asks)."""
        driven = self.driven
        return driven is None or (self._slot is not None and not (driven.idle and self._batch is None))

    def release_kv(self, plan: IterationPlan) -> int:
        """Drop the sequences in flight to free their KV blocks; returns the blocks freed.

        Refused (0) when they already have work in `plan` (it would read freed blocks), for a DPO pair
        once a backward of it has started (its gradient is then part-way into the adapter's), and for a
        sequence dropped `MAX_DROPS` times in a row already (it keeps its blocks: `sequence_kv`).
        """
        seq = self._current()
        if seq is None or not seq.started or self._last_planned == plan.step_id:
            return 0
        assert self._batch is not None
        group = self._batch.in_flight()
        if len(group) > 1 and any(s.layer_end != [s.length] * s.num_layers for s in group):
            return 0
        freed = self._kv.release(group, plan)
        for member in group if freed else ():
            if member.started:
                self._validation.redo(member.sequence_id)
                member.reset()
        return freed

    # ------------------------------------------------------------------------------ scheduling

    def schedule(self, plan: IterationPlan, forward_tokens: int, backward_token_layers: int) -> float:
        """Append up to the given amounts of work to `plan.training`; returns the tokens to charge.

        Forward work uses `forward_tokens` (one window of the sequence in flight), backward work
        `backward_token_layers`; a sequence whose forward completes here may start its backward in
        the same plan (the engine runs tasklets after the forward). 0 when nothing fit: no budget,
        no free KV block, or no free adapter slot.
        """
        # Started first: a job resumed at its very end still needs the engine to write its final save.
        if not self.runnable or not self._ensure_started(plan):
            return 0.0
        if self._batch is None and not self._next_batch(plan):
            return 0.0
        seq, batch = self._current(), self._batch
        assert seq is not None and batch is not None
        charged = 0.0
        target = self._forward_target(seq)
        if target is not None:
            charged += self._schedule_forward(plan, target, seq, forward_tokens)
        if seq.forward_end == seq.length and batch.forward_only(seq):
            self._complete_forward_only(plan)
        elif self._forward_target(seq) is None:
            charged += self._schedule_backward(plan, seq, backward_token_layers)
        if charged:
            self._last_planned = plan.step_id
            self._progress.reached(batch, (seq,) if target is None or target is seq else (target, seq))
        return charged

    def _ensure_started(self, plan: IterationPlan) -> bool:
        """Pin a bank slot for the trainable adapter and send the job to the engine (once)."""
        if self._slot is None:
            if self.job_id in plan.training.job_parks:  # parked in this very plan: it comes back in the next
                return False
            ref, parking = AdapterRef(self.spec.adapter_id, f"training:{self.job_id}", f"training:{self.job_id}"), \
                self.parking
            grant = self._adapters.acquire(ref, keep_free=0 if parking is None else parking.keep_free)
            if grant is None:
                if parking is not None:
                    parking.missed()
                self.slot_wait = (f"all {self._adapters.num_slots} adapter slots of its engine are pinned by "
                                  "requests and other jobs; it starts when one is free")
                return False
            self.slot_wait = None
            if grant.evicted_slot is not None:
                plan.adapter_unloads.append(grant.evicted_slot)
            self._slot = grant.slot  # the AdapterLoad is not sent: JobStart (or JobUnpark) installs the weights
            if parking is not None and parking.took_slot():
                plan.training.job_unparks.append(JobUnpark(self.job_id, grant.slot))
        if not self._started:
            plan.training.job_starts.append(self._start_message(self._slot))
            self._started = True
        return True

    def _start_message(self, slot: int) -> JobStart:
        """What the engine needs to create the job's trainable adapter in `slot`."""
        spec = self.spec
        return JobStart(
            job_id=spec.job_id, adapter_slot=slot, lora=spec.lora,
            optimizer=spec.optimizer, seed=spec.seed, examples=spec.examples,
            resume_from=spec.resume_from, init_adapter=spec.init_adapter,
            validation_examples=spec.validation_examples,
            base_model_name_or_path=spec.base_model_name_or_path, loss=spec.loss,
            rejected_examples=spec.rejected_examples, validation_rejected=spec.validation_rejected)

    def _next_batch(self, plan: IterationPlan) -> bool:
        """Set up the next batch, or plan the final save when the last epoch is done."""
        spec = self.spec
        if self._validation.pending:
            self._validation.pending = False
            self._batch = self._validation.batch(self.position)
            return True
        if self.driven is not None:
            return self._next_driven(plan, self.driven)
        if self.position.epoch >= spec.n_epochs:
            if not self.hold_finish:
                self._finish(plan)
            return False
        if spec.is_reinforcement:
            return self._next_fed_batch()
        indices, after = self.position.next_batch(len(spec.examples), spec.batch_size)
        if spec.is_preference:
            self._batch = preference_batch(spec, after, indices, self._references.known,
                                           f"{spec.job_id}/s{after.step}")
            return True
        self._batch = supervised_batch(spec, after, indices)
        return True

    def _next_driven(self, plan: IterationPlan, driven: DrivenOps) -> bool:
        """A driven run's next call: its batch, or its step, save or load planned here (no batch)."""
        op = driven.next_call()
        if op is None:
            return False
        call = op.call
        if isinstance(call, ForwardBackwardCall):
            self._batch = driven.batch(op, call)
            return True
        if isinstance(call, OptimStepCall):
            driven.plan_step(plan, call)
        elif isinstance(call, SaveCall):
            driven.plan_save(plan, call, self.trained_tokens)  # its calls run one after another
        else:
            self._restart(plan, call)
            driven.planned_load(plan, call)
        self._last_planned = plan.step_id
        self._progress.add()
        return False

    def _restart(self, plan: IterationPlan, load: ResolvedLoad) -> None:
        """The engine drops the job's adapter and starts it again from a saved folder, in this plan."""
        assert self._slot is not None  # started
        plan.training.job_stops.append(self.job_id)
        # A driven run's spec has no examples of its own: only where the weights come from changes.
        plan.training.job_starts.append(dataclasses.replace(
            self._start_message(self._slot), resume_from=load.folder if load.with_optimizer else None,
            init_adapter=None if load.with_optimizer else load.folder))

    def _next_fed_batch(self) -> bool:
        """The next graded batch; False while there is none (the driver is sampling it)."""
        if not self._fed:
            return False
        fed = self._fed.pop(0)
        self._batch = fed_batch_progress(fed, self.spec.num_layers, f"{self.job_id}/s{fed.after.step}")
        self._step_metrics[fed.after.step] = dict(fed.metrics)
        return True

    def _finish(self, plan: IterationPlan) -> None:
        path = f"{self.spec.output_dir}/final"
        plan.training.saves.append(SaveAdapter(self.job_id, path, self.position.step, final=True))
        self.state = JobState.FINISHING

    def _schedule_forward(self, plan: IterationPlan, seq: SequenceProgress, lead: SequenceProgress,
                          budget: int) -> float:
        """One window of `seq` (the current sequence `lead`, or the next of its DPO pair)."""
        count = min(budget, self.spec.max_window_tokens, seq.length - seq.forward_end)
        if count < 1:
            return 0.0
        if not self._kv.allocate(seq, lead, seq.forward_end + count):
            if self._kv.never_fits(seq):
                self._end(plan, JobState.FAILED)
                self._pending.append(JobEvent(
                    self.job_id, JobEventKind.FAILED, self.position.step, code="sequence_too_long",
                    message=f"a training sequence of {seq.length} tokens needs more KV blocks than the "
                            f"{self._kv.num_blocks} of {self._kv.block_size} tokens the job may use"))
            return 0.0
        if not seq.started and not self._start_sequence(plan, seq):
            self._kv.free_now(seq.sequence_id)
            return 0.0
        plan.training.forward_windows.append(ForwardWindow(
            seq.sequence_id, seq.forward_end, count, self._kv.table(seq.sequence_id)))
        seq.forward_end += count
        return float(count)

    def _start_sequence(self, plan: IterationPlan, seq: SequenceProgress) -> bool:
        """Send the sequence's start; False while a DPO pair's reference sums are not back yet."""
        batch, spec = self._batch, self.spec
        assert batch is not None
        pair = None
        if spec.is_preference and not batch.forward_only(seq):
            pair = pair_start(batch, seq, self._references.known)
            if pair is None:
                return False
        if seq.reference and not batch.evaluation:
            self._references.expect(seq, trained_tokens(self._example(seq)))
        normalizer = 1 if spec.is_preference else batch.normalizer  # DPO's coefficient has the mean
        plan.training.sequence_starts.append(SequenceStart(
            seq.sequence_id, self.job_id, seq.example_index, normalizer, evaluate=batch.evaluation,
            rejected=seq.rejected, reference=seq.reference, pair=pair, example=seq.example,
            inputs=seq.inputs, loss=seq.loss, report_logprobs=seq.report_logprobs,
            marks_gradient=seq.marks_gradient))
        seq.started = True
        return True

    def _example(self, seq: SequenceProgress) -> TrainingExample:
        if seq.example is not None:
            return seq.example
        return (self.spec.rejected_examples if seq.rejected else self.spec.examples)[seq.example_index]

    def _schedule_backward(self, plan: IterationPlan, seq: SequenceProgress, budget: int) -> float:
        """Layer-major tasklets (last layer first, last tokens first) within `budget` token-layers."""
        tasklets = seq.take_backward(budget, self.spec.min_tasklet_tokens)
        plan.training.backward_tasklets.extend(tasklets)
        if seq.backward_done:
            self._complete_sequence(plan)
        return sum(backward_tasklet_tokens(t.end - t.start, 1, seq.num_layers) for t in tasklets)

    def _complete_forward_only(self, plan: IterationPlan) -> None:
        """A validation or reference sequence's last window is planned (the engine drops it after the
        forward); the batch goes on (a validation batch ends with its last sequence)."""
        batch = self._batch
        assert batch is not None
        self._kv.done(batch.sequences[batch.current])
        batch.current += 1
        if batch.current == len(batch.sequences):
            if self.driven is not None:
                self.driven.batch_planned(plan)
            else:
                self._validation.planned(batch, plan)
            self._batch = None

    def _complete_sequence(self, plan: IterationPlan) -> None:
        """The sequence's last tasklet is planned: free its blocks after the step, go to the next."""
        batch = self._batch
        assert batch is not None
        self._kv.done(batch.sequences[batch.current])
        batch.current += 1
        if batch.current < len(batch.sequences):
            return
        if self.driven is not None:  # its client asks for the optimizer step
            self.driven.batch_planned(plan)
            self._batch = None
            return
        spec, before = self.spec, self.position
        trained = sum(1 for s in batch.sequences if not batch.forward_only(s))
        plan.training.optimizer_steps.append(OptimizerStep(self.job_id, batch.after.step, trained,
                                                           batch.normalizer))
        self._planned_tokens += batch.normalizer
        if batch.after.epoch > before.epoch:  # an epoch ends with this step: checkpoint, evaluate
            path = f"{spec.output_dir}/ckpt-step-{batch.after.step}"
            references = dict(self._references.known) if spec.is_preference else None
            plan.training.saves.append(SaveAdapter(self.job_id, path, batch.after.step,
                                                   batch.after.to_dict(), self._planned_tokens,
                                                   references))
            self._validation.pending = bool(spec.validation_examples)
        self.position = batch.after
        self._batch = None

    # ------------------------------------------------------------------------------ results

    def update(self, plan: IterationPlan, result: IterationResult) -> list[JobEvent]:
        """Consume what the engine did for this job in `plan`; returns the job's new events."""
        events, self._pending = self._pending, []
        self._kv.free_done()
        report = result.training
        fault = next((f for f in report.faults if f.job_id == self.job_id), None)
        if fault is not None:
            self.fault(fault.message)  # before `driven.update`, which would end the call as done
        for failure in report.failures:
            if failure.job_id == self.job_id and not self.state.is_finished:
                self._end(None, JobState.FAILED)  # the engine has dropped the job already
                events.append(JobEvent(self.job_id, JobEventKind.FAILED, self.position.step,
                                       code=failure.code, message=failure.message))
        for window in report.windows:
            self._references.add(window.sequence_id, window.loss_sum, window.num_tokens)
        if self.driven is not None:
            self.driven.update(plan, result)
        for step in report.steps:
            if step.job_id == self.job_id:
                self.trained_tokens += step.num_tokens
                metrics = {**step.metrics, **self._step_metrics.pop(step.step, {})}
                events.append(JobEvent(self.job_id, JobEventKind.STEP, step.step, loss=step.loss,
                                       grad_norm=step.grad_norm, learning_rate=step.learning_rate,
                                       num_tokens=step.num_tokens, metrics=metrics))
        for saved in report.saved:
            if saved.job_id == self.job_id:
                events.append(self._on_saved(plan, saved.path, saved.step))
        events.extend(self._validation.collect(plan, result, self.position, self.state.is_finished))
        return events

    def _on_saved(self, plan: IterationPlan, path: str, step: int) -> JobEvent:
        if self.state == JobState.FINISHING:
            self._end(None, JobState.SUCCEEDED)  # the engine dropped the job after the final save
            return JobEvent(self.job_id, JobEventKind.SUCCEEDED, step, path=path,
                            message="the job succeeded")
        return JobEvent(self.job_id, JobEventKind.CHECKPOINT, step, path=path,
                        epoch=self.position.epoch, message=f"checkpoint at step {step}")
