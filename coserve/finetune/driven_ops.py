"""A driven run's calls as a fine-tuning job's work: the job's side of `contract.training_calls`.

A driven job (`FinetuneJobSpec.driven`) has no data of its own: its client sends calls, and the job
does them one after the other, each as the work a fine-tuning job knows:

* `forward_backward` / `forward`: a batch of its data, one sequence per datum, trained (or, forward
  only, evaluated) under the policy's budget like any batch, with no optimizer step at its end: the
  gradient stays in the adapter until `optim_step`;
* `optim_step`: one `OptimizerStep` with the call's own AdamW hyperparameters;
* `save_state` / `save_weights_for_sampler`: one `SaveAdapter` (resumable, or a PEFT folder);
* `load_state`: the engine drops the job's adapter and starts it again from the saved folder.

A call is done when the result of the plan holding its last work comes back; its outcome is then set
on the `DrivenOp`, which the caller (`cluster.training_runs`) holds. `DrivenOps` is the job's
`BatchSource` (`batch_source`): its batches are its calls'. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import JobState
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.training_calls import (
    CallFailure,
    CallOutcome,
    CallTimings,
    DatumOutput,
    ForwardBackwardCall,
    ForwardBackwardOutcome,
    LoadOutcome,
    OptimStepCall,
    OptimStepOutcome,
    SaveCall,
    SaveOutcome,
)
from coserve.contract.training_plan import OptimizerStep, SaveAdapter, TrainingExample
from coserve.finetune.batch_source import BatchSource, NoBatch, SourceJob
from coserve.finetune.progress import BatchProgress, SequenceProgress


@dataclass(slots=True)
class ResolvedLoad:
    """A `LoadCall` whose path the run checked and resolved: the folder on disk, and the optimizer steps
    its state had done."""

    folder: str
    tinker_path: str
    with_optimizer: bool
    steps: int


DrivenCall = ForwardBackwardCall | OptimStepCall | SaveCall | ResolvedLoad


@dataclass(slots=True)
class DrivenOp:
    """One call of a driven run, and its outcome once it is done."""

    call_id: str
    call: DrivenCall
    created: float  # when it was queued (the caller's clock)
    outcome: CallOutcome | None = None
    started: float | None = None  # when its first work was planned (`DrivenOps`' clock)
    first_plan: int | None = None  # step ids of the first and last plans with its work
    last_plan: int | None = None
    sequences: list[str] = field(default_factory=list)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.outcome is not None


class DrivenOps(BatchSource):
    """A driven job's calls, in order (module docstring).

    Args:
        job_id: the job (its sequence ids and the engine's reports name it).
        output_dir: where its saves go (`weights/<name>`, `sampler_weights/<name>`).
        num_layers: the model's (a sequence's backward runs over every layer).
        steps: optimizer steps done already (a run resumed from a saved state).
        clock: seconds (`time.time`, the clock `TrainingRuns` dates a call's arrival with): a call's timings.
    """

    def __init__(self, job_id: str, output_dir: str, num_layers: int, steps: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self._job_id, self._output_dir, self._num_layers = job_id, output_dir, num_layers
        self._clock = clock
        self.steps = steps
        self._queue: deque[DrivenOp] = deque()
        self._current: DrivenOp | None = None
        self._waiting_on: int | None = None  # the plan whose result completes the current call
        self._gradient_tokens = 0  # tokens back-propagated since the last optimizer step
        self._count = 0

    def submit(self, op: DrivenOp) -> None:
        self._queue.append(op)

    @property
    def idle(self) -> bool:
        return self._current is None and not self._queue

    @property
    def parks(self) -> bool:
        return True

    def pending(self) -> list[DrivenOp]:
        return ([self._current] if self._current is not None else []) + list(self._queue)

    def fail_current(self, message: str, own: bool = True) -> str | None:
        """The current call's work could not run: it fails with `message` (`own`: its own error, else a
        generic one, Tinker's "server" category). Returns the first sequence of a failed
        `forward_backward` (its gradient is to be put back), "" for a failed `optim_step` or save (they
        change nothing when they fail); None when a load or nothing was current (the run's state is not
        known: the run fails)."""
        op = self._current
        if op is None or isinstance(op.call, ResolvedLoad):
            return None
        op.outcome = CallFailure("engine_error", f"the engine could not run this call: {message}", user=own)
        if isinstance(op.call, ForwardBackwardCall) and op.call.backward and self._waiting_on is not None:
            self._gradient_tokens -= sum(len(d.token_ids) - 1 for d in op.call.data)  # `batch_planned` counted it
        self._current, self._waiting_on = None, None
        return op.sequences[0] if isinstance(op.call, ForwardBackwardCall) and op.sequences else ""

    def fail_all(self, failure: CallFailure) -> None:
        """The job ended: every call not done gets `failure`."""
        for op in self.pending():
            op.outcome = failure
        self._queue.clear()
        self._current, self._waiting_on = None, None

    def end(self, state: JobState) -> None:
        self.fail_all(CallFailure("run_ended", f"the training run ended ({state.value})", user=False))

    # ------------------------------------------------------------------------------ planning

    def next_batch(self, job: SourceJob, plan: IterationPlan) -> BatchProgress | NoBatch:
        """The next call: a `forward_backward`'s batch, or its step, save or load planned here (its calls
        run one after another)."""
        op = self.next_call()
        if op is None:
            return NoBatch.WAIT
        call = op.call
        if isinstance(call, ForwardBackwardCall):
            return self.batch(op, call)
        if isinstance(call, OptimStepCall):
            self.plan_step(plan, call)
        elif isinstance(call, SaveCall):
            self.plan_save(plan, call, job.trained_tokens)
        else:
            # The engine drops the job's adapter and starts it again from the saved folder, in this plan: a
            # driven run's spec has no examples of its own, only where the weights come from changes.
            plan.training.job_stops.append(self._job_id)
            plan.training.job_starts.append(dataclasses.replace(
                job.restart_message(), resume_from=call.folder if call.with_optimizer else None,
                init_adapter=None if call.with_optimizer else call.folder))
            self.planned_load(plan, call)
        return NoBatch.PLANNED

    def next_call(self) -> DrivenOp | None:
        """The call to plan now (None: none, or the current one waits for its plan's result)."""
        if self._current is not None:
            return None
        while self._queue:
            op = self._queue.popleft()
            if isinstance(op.call, OptimStepCall) and self._gradient_tokens == 0:
                op.outcome = CallFailure("no_gradient", "optim_step needs a forward_backward since the last "
                                         "step: there is no gradient to apply")
                continue
            self._current = op
            return op
        return None

    def batch(self, op: DrivenOp, call: ForwardBackwardCall) -> BatchProgress:
        """The call's batch: one sequence per datum, trained from its second token, no normalizer."""
        self._count += 1
        sequences = []
        for k, datum in enumerate(call.data):
            ids = list(datum.token_ids)
            seq = SequenceProgress(f"{self._job_id}/c{self._count}.{k}", k, len(ids), self._num_layers,
                                   group=k, example=TrainingExample(ids, [False] + [True] * (len(ids) - 1)),
                                   inputs=datum.inputs, loss=call.loss, report_logprobs=True,
                                   marks_gradient=k == 0 and call.backward)
            seq.reset()
            sequences.append(seq)
            op.sequences.append(seq.sequence_id)
        position = DataPosition(seed=0, step=self.steps)
        return BatchProgress(after=position, normalizer=1, sequences=sequences, evaluation=not call.backward)

    def planned(self, plan: IterationPlan, at: float | None = None) -> None:
        """The current call has work in `plan`, made at `at` (None: now)."""
        op = self._current
        if op is not None:
            if op.first_plan is None:
                op.first_plan, op.started = plan.step_id, self._clock() if at is None else at
            op.last_plan = plan.step_id

    def batch_planned(self, batch: BatchProgress, plan: IterationPlan) -> bool:
        """The current call's batch has all its work in `plan`; its client asks for the optimizer step."""
        op = self._current
        assert op is not None and isinstance(op.call, ForwardBackwardCall)
        if op.call.backward:
            self._gradient_tokens += sum(len(d.token_ids) - 1 for d in op.call.data)
        self._waiting_on = plan.step_id
        return False

    def plan_step(self, plan: IterationPlan, call: OptimStepCall) -> None:
        plan.training.optimizer_steps.append(OptimizerStep(
            self._job_id, self.steps + 1, 0, max(1, self._gradient_tokens), adam=call.adam))
        self.planned(plan)
        self._waiting_on = plan.step_id

    def plan_save(self, plan: IterationPlan, call: SaveCall, trained_tokens: int) -> None:
        kind = "weights" if call.resumable else "sampler_weights"
        position = DataPosition(seed=0, step=self.steps).to_dict() if call.resumable else None
        plan.training.saves.append(SaveAdapter(self._job_id, f"{self._output_dir}/{kind}/{call.name}", self.steps,
                                               position, trained_tokens if call.resumable else None))
        self.planned(plan)
        self._waiting_on = plan.step_id

    def planned_load(self, plan: IterationPlan, call: ResolvedLoad) -> None:
        """The engine restarts the job from `call.folder` in `plan` (its gradient goes with the old state)."""
        self._gradient_tokens = 0
        self.planned(plan)
        self._waiting_on = plan.step_id

    # ------------------------------------------------------------------------------ results

    def update(self, plan: IterationPlan, result: IterationResult) -> None:
        """Collect what the engine did for the current call in `plan`; finish it when it is done."""
        op = self._current
        if op is None:
            return
        mine = set(op.sequences)
        work = plan.training
        if any(w.sequence_id in mine for w in work.forward_windows) or \
                any(t.sequence_id in mine for t in work.backward_tasklets):
            self.planned(plan, self._clock() - result.timings.total_s)  # made before the engine ran it
        dropped = set(plan.training.sequence_drops)
        for sequence_id in op.sequences:
            if sequence_id in dropped:  # redone later: its windows report again
                op.losses.pop(sequence_id, None)
                op.logprobs.pop(sequence_id, None)
        for window in result.training.windows:
            if window.sequence_id in op.sequences:
                op.losses[window.sequence_id] = op.losses.get(window.sequence_id, 0.0) + window.loss_sum
                if window.logprobs is not None:
                    op.logprobs[window.sequence_id] = window.logprobs
        if self._waiting_on != plan.step_id:
            return
        op.outcome = self._outcome(op, result)
        if isinstance(op.outcome, ForwardBackwardOutcome | OptimStepOutcome):
            op.outcome.timings = self._timings(op)
        self._current, self._waiting_on = None, None

    def _timings(self, op: DrivenOp) -> CallTimings:
        started = op.created if op.started is None else op.started
        first = op.first_plan if op.first_plan is not None else 0
        last = op.last_plan if op.last_plan is not None else first
        return CallTimings(max(0.0, started - op.created), max(0.0, self._clock() - started), last - first + 1)

    def _outcome(self, op: DrivenOp, result: IterationResult) -> CallOutcome:
        call = op.call
        if isinstance(call, ForwardBackwardCall):
            # Entry t of a sequence's log-probs is token t's; a datum's output t is token t + 1's.
            outputs = [DatumOutput(op.logprobs.get(s, [])[1:]) for s in op.sequences]
            return ForwardBackwardOutcome(outputs, sum(op.losses.values()))
        if isinstance(call, OptimStepCall):
            report = next((s for s in result.training.steps if s.job_id == self._job_id), None)
            if report is None:
                return CallFailure("step_failed", "the optimizer step did not run", user=False)
            self.steps, self._gradient_tokens = report.step, 0
            return OptimStepOutcome(report.step, report.grad_norm, report.learning_rate)
        if isinstance(call, SaveCall):
            if not any(s.job_id == self._job_id for s in result.training.saved):
                return CallFailure("save_failed", "the weights were not written", user=False)
            kind = "weights" if call.resumable else "sampler_weights"
            return SaveOutcome(f"tinker://{self._job_id}/{kind}/{call.name}")
        self.steps = call.steps if call.with_optimizer else 0  # a fresh optimizer: its count restarts
        return LoadOutcome(call.tinker_path, self._job_id)


def driven_calls(source: BatchSource) -> DrivenOps | None:
    """A job's calls when it is a driven run (its batches are its calls), else None."""
    return source if isinstance(source, DrivenOps) else None
