"""One co-served fine-tuning job as the scheduler sees it: data order, batches, sequences, and the work they need.

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
Its batches come from its method's `BatchSource` (`batch_source`: supervised, DPO, reinforcement, a run
driven by its client's calls), the validation pass first when one is due; the batch in flight is planned
sequence by sequence by a `BatchRun` (`batch_run`); its adapter slot is `job_slot`'s.
Pure Python: no torch, no Ray. The job's spec, states and events are in `coserve.contract.job_spec`.
"""

from __future__ import annotations

from coserve.contract.data_position import DataPosition
from coserve.contract.job_runner import SequenceRestarts
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind, JobPhase, JobState
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.training_plan import JobStart, OptimizerStep, SaveAdapter, sequence_job
from coserve.finetune.batch_run import BatchRun
from coserve.finetune.batch_source import BatchSource, NoBatch
from coserve.finetune.job_slot import JobSlot
from coserve.finetune.kept_progress import KeptProgress
from coserve.finetune.methods import batch_sources
from coserve.finetune.progress import BatchProgress, SequenceProgress
from coserve.finetune.run_parking import RunParking
from coserve.finetune.sequence_kv import SequenceKV
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager


class CoservedJob:
    """The scheduler's state of one job; see the module docstring.

    Args:
        spec: the job.
        kv: the KV block manager of the engine the job trains on (its sequences' blocks).
        adapters: that engine's adapter slots (the job pins one for its trainable adapter).
    """

    def __init__(self, spec: FinetuneJobSpec, kv: KVBlockManager, adapters: AdapterSlots) -> None:
        self.spec = spec
        self._kv = SequenceKV(kv)
        self.source, self._validation = batch_sources(spec)
        self._adapter = JobSlot(spec.job_id, spec.adapter_id, adapters, self.source.parks)
        self.state = JobState.RUNNING
        self.position = spec.start_position or DataPosition(seed=spec.seed)
        self._started = False  # JobStart sent
        self._run: BatchRun | None = None  # the batch in flight
        self._stop_sent = False
        self._last_planned = -1  # step id of the last plan this job put work into
        # Trained tokens of completed optimizer steps, from the checkpoint's count on a resume (so the
        # job's count continues); and of the steps planned so far, which a checkpoint keeps.
        self.trained_tokens = spec.start_trained_tokens
        self._planned_tokens = spec.start_trained_tokens
        self._pending: list[JobEvent] = []  # events found while planning, reported by `update`
        self._step_metrics: dict[int, dict[str, float]] = {}  # a planned step's batch's metrics, for its event
        self._progress = KeptProgress()  # the watchdog's marker
        self._failure: tuple[str, str] | None = None  # (code, message) to fail with in the next plan
        self._rollback: str | None = None  # a failed call's first sequence: its gradient is put back next plan

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

    def note_progress(self, amount: int) -> None:
        """Work done for the job outside its plans (a reinforcement job's rollouts sampled and graded)."""
        self._progress.add(amount)

    @property
    def sequence_restarts(self) -> SequenceRestarts:
        """Its sequences that KV reclaim dropped `MAX_DROPS` times in a row (they then kept their blocks)."""
        return SequenceRestarts(self._kv.kept, self._kv.kept_tokens)

    @property
    def kv_reserve(self) -> int:
        """Free KV blocks inference's admissions must leave for its kept sequence (`sequence_kv`)."""
        run = self._run
        return self._kv.reserve(run.batch.in_flight()) if self._kv.holding and run is not None and self.runnable else 0

    @property
    def layer_tokens(self) -> tuple[int, int]:
        """Backward tokens left in the layer whose tasklets come next, and in a whole layer ((0, 0)
        outside the backward phase)."""
        return (0, 0) if self._run is None else self._run.layer_tokens

    @property
    def between_batches(self) -> bool:
        """Started, with no batch in flight: the engine holds the weights of `position.step` (unless a
        batch waits at its source: a reinforcement job's graded batch)."""
        return self._started and self._run is None

    @property
    def failing(self) -> bool:
        """A failure is asked for: the job fails in its next plan."""
        return self._failure is not None

    @property
    def runnable(self) -> bool:
        """Whether the job has work to schedule (it is running and not waiting for its final save)."""
        return self.state == JobState.RUNNING

    @property
    def has_work(self) -> bool:
        """Runnable, and not idle (a driven run without a call to do: an engine with only those sleeps)."""
        return self.runnable and not (self.source.idle and self._run is None)

    @property
    def parking(self) -> RunParking | None:
        """When the job gives its slot back between its calls (a driven run), else None."""
        return self._adapter.parking

    @property
    def slot_wait(self) -> str | None:
        """Why its last attempt to take an adapter slot failed (None: it did not)."""
        return self._adapter.wait

    @property
    def phase(self) -> JobPhase:
        return JobPhase.FORWARD if self._run is None else self._run.phase

    def _current_sequence(self) -> SequenceProgress | None:
        return None if self._run is None else self._run.current()

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
        whole, a generic one): a source that goes on (a driven run's call fails with `message`; a
        `forward_backward`'s gradient is put back in the next plan, `apply_failure`) drops its batch; any
        other job fails in its next plan."""
        if self.state.is_finished:
            return
        failed = self.source.fail_current(message, own)
        if failed is None:
            self.fail("engine_error", f"the engine could not run the job's work: {message}")
            return
        self._kv.free_all(self._current_sequence())
        self._run = None
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
        self._kv.free_all(self._current_sequence())
        self._adapter.release()
        if plan is not None and self._started and not self._stop_sent:
            plan.training.job_stops.append(self.job_id)
            self._stop_sent = True
        self.source.end(state)

    def settle(self, plan: IterationPlan) -> None:
        """A run that parks gives its slot back between its calls when something waits for one, or after a
        while (`run_parking`); the engine keeps its state in host memory."""
        if not self._started or self.state.is_finished:
            return
        rolling_back = any(sequence_job(s) == self.job_id for s in plan.training.gradient_rollbacks)
        self._adapter.park(plan, self.source.idle and self._run is None and self._rollback is None
                           and not rolling_back)

    @property
    def claims_slot(self) -> bool:
        """Whether it counts against its engine's adapter slots when jobs are placed: a job does; a run that
        parks only while it holds one for a call (an idle one gives its slot to whoever asks)."""
        idle = self.source.idle and self._run is None
        return self._adapter.parking is None or (self._adapter.slot is not None and not idle)

    def release_kv(self, plan: IterationPlan) -> int:
        """Drop the sequences in flight to free their KV blocks; returns the blocks freed.

        Refused (0) when they already have work in `plan` (it would read freed blocks), for a DPO pair
        once a backward of it has started (its gradient is then part-way into the adapter's), and for a
        sequence dropped `MAX_DROPS` times in a row already (it keeps its blocks: `sequence_kv`).
        """
        seq = self._current_sequence()
        if seq is None or not seq.started or self._last_planned == plan.step_id:
            return 0
        assert self._run is not None
        return self._run.release(plan)

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
        if self._run is None and not self._next_batch(plan):
            return 0.0
        run = self._run
        assert run is not None
        charged, moved = run.schedule(plan, forward_tokens, backward_token_layers)
        if run.too_long is not None:
            self._end(plan, JobState.FAILED)
            self._pending.append(JobEvent(
                self.job_id, JobEventKind.FAILED, self.position.step, code="sequence_too_long",
                message=f"a training sequence of {run.too_long.length} tokens needs more KV blocks than the "
                        f"{self._kv.num_blocks} of {self._kv.block_size} tokens the job may use"))
            return 0.0
        if run.done:  # its last work is planned: its source says whether an optimizer step follows
            self._run = None
            if run.source.batch_planned(run.batch, plan):
                self._plan_step(plan, run.batch)
        if charged:
            self._last_planned = plan.step_id
            self._progress.reached(run.batch, moved)
        return charged

    def _ensure_started(self, plan: IterationPlan) -> bool:
        """Pin a bank slot for the trainable adapter and send the job to the engine (once)."""
        if not self._adapter.take(plan):
            return False
        if not self._started:
            plan.training.job_starts.append(self.restart_message())
            self._started = True
        return True

    def restart_message(self) -> JobStart:
        """What the engine needs to create the job's trainable adapter in the slot it holds."""
        spec, slot = self.spec, self._adapter.slot
        assert slot is not None  # started
        return JobStart(
            job_id=spec.job_id, adapter_slot=slot, lora=spec.lora,
            optimizer=spec.optimizer, seed=spec.seed, examples=spec.examples,
            resume_from=spec.resume_from, init_adapter=spec.init_adapter,
            validation_examples=spec.validation_examples,
            base_model_name_or_path=spec.base_model_name_or_path, loss=spec.loss,
            rejected_examples=spec.rejected_examples, validation_rejected=spec.validation_rejected)

    def _next_batch(self, plan: IterationPlan) -> bool:
        """Take the next batch (a due validation pass first), or plan what comes instead of one: the final
        save once the data is done, or a driven run's step, save or load."""
        source: BatchSource = self._validation
        got = source.next_batch(self, plan)
        if got is NoBatch.WAIT:
            source = self.source
            got = source.next_batch(self, plan)
        if isinstance(got, BatchProgress):
            self._run = BatchRun(self.spec, got, source, self._kv)
            return True
        if got is NoBatch.PLANNED:
            self._last_planned = plan.step_id
            self._progress.add()
        elif got is NoBatch.DONE:
            plan.training.saves.append(SaveAdapter(self.job_id, f"{self.spec.output_dir}/final", self.position.step,
                                                   final=True))
            self.state = JobState.FINISHING
        return False

    def _plan_step(self, plan: IterationPlan, batch: BatchProgress) -> None:
        """The batch's optimizer step; a checkpoint (and a validation pass) when it ends an epoch."""
        spec, before = self.spec, self.position
        trained = sum(1 for s in batch.sequences if not batch.forward_only(s))
        plan.training.optimizer_steps.append(OptimizerStep(self.job_id, batch.after.step, trained,
                                                           batch.normalizer))
        self._planned_tokens += batch.normalizer
        if batch.metrics:
            self._step_metrics[batch.after.step] = dict(batch.metrics)
        if batch.after.epoch > before.epoch:  # an epoch ends with this step: checkpoint, evaluate
            path = f"{spec.output_dir}/ckpt-step-{batch.after.step}"
            plan.training.saves.append(SaveAdapter(self.job_id, path, batch.after.step, batch.after.to_dict(),
                                                   self._planned_tokens, self.source.checkpoint_state()))
            self._validation.epoch_ended()
        self.position = batch.after

    # ------------------------------------------------------------------------------ results

    def update(self, plan: IterationPlan, result: IterationResult) -> list[JobEvent]:
        """Consume what the engine did for this job in `plan`; returns the job's new events."""
        events, self._pending = self._pending, []
        self._kv.free_done()
        report = result.training
        fault = next((f for f in report.faults if f.job_id == self.job_id), None)
        if fault is not None:
            self.fault(fault.message)  # before the source's update, which would end a driven call as done
        for failure in report.failures:
            if failure.job_id == self.job_id and not self.state.is_finished:
                self._end(None, JobState.FAILED)  # the engine has dropped the job already
                events.append(JobEvent(self.job_id, JobEventKind.FAILED, self.position.step,
                                       code=failure.code, message=failure.message))
        self.source.update(plan, result)
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
