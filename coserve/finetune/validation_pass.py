"""A fine-tuning job's validation passes, as the scheduler runs them (a `BatchSource`, asked before the job's
own): after each epoch that ends with a checkpoint, every validation example runs forward only (no gradient,
no optimizer step); the windows' reported losses are summed per sequence, and once the pass's last window
has run, one validation event gives the mean token loss (a DPO job's: the pairs' DPO loss and rewards, its
method's `metrics_of`). The pass's batches and their sequences' terms are its method's. Pure Python."""

from __future__ import annotations

from collections.abc import Callable

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.finetune.batch_source import BatchSource, NoBatch, SourceJob, StartTerms
from coserve.finetune.progress import BatchProgress, SequenceProgress

Sums = dict[str, tuple[float, int]]  # validation sequence -> (loss sum, tokens)


class ValidationPass(BatchSource):
    """The validation of one job: the pass to run next, and the losses of the one in flight.

    Args:
        spec: the job.
        batch_of: its method's validation batch after a data position (None: the method validates nothing).
        terms: its method's sequence start terms (`BatchSource.start_terms`).
        metrics_of: the pass's metrics from its sequences' sums (None: the mean token loss alone).
    """

    def __init__(self, spec: FinetuneJobSpec, batch_of: Callable[[DataPosition], BatchProgress] | None = None,
                 terms: Callable[[BatchProgress, SequenceProgress], StartTerms | None] | None = None,
                 metrics_of: Callable[[BatchProgress, Sums], dict[str, float]] | None = None) -> None:
        self.spec = spec
        self._batch_of, self._terms, self._metrics_of = batch_of, terms, metrics_of
        self._pending = False  # an epoch ended: evaluate the validation set next
        self._losses: Sums = {}
        self._report_step = -1  # plan whose result completes the pass
        self._batch: BatchProgress | None = None  # the pass whose metrics are pending

    def epoch_ended(self) -> None:
        """An epoch ended with a checkpoint: a pass is due (when there is a validation set)."""
        self._pending = self._batch_of is not None and bool(self.spec.validation_examples)

    def next_batch(self, job: SourceJob, plan: IterationPlan) -> BatchProgress | NoBatch:
        """The pass's sequences (forward only) for the position it validates, when one is due."""
        if not self._pending or self._batch_of is None:
            return NoBatch.WAIT
        self._pending = False
        return self._batch_of(job.position)

    def start_terms(self, batch: BatchProgress, seq: SequenceProgress) -> StartTerms | None:
        return StartTerms(None, batch.normalizer) if self._terms is None else self._terms(batch, seq)

    def batch_planned(self, batch: BatchProgress, plan: IterationPlan) -> bool:
        """The pass's last window is in `plan`: its result completes the pass."""
        self._report_step, self._batch = plan.step_id, batch
        return False

    def redo(self, sequence_id: str) -> None:
        """A validation sequence was dropped: its windows are redone."""
        self._losses.pop(sequence_id, None)

    def collect(self, plan: IterationPlan, result: IterationResult, position: DataPosition,
                finished: bool) -> list[JobEvent]:
        """Add `result`'s validation windows; the pass's event once it is complete (none for a job that
        has ended meanwhile)."""
        prefix = f"{self.spec.job_id}/v"
        for window in result.training.windows:
            if window.sequence_id.startswith(prefix):
                total, count = self._losses.get(window.sequence_id, (0.0, 0))
                self._losses[window.sequence_id] = (total + window.loss_sum, count + window.num_tokens)
        if plan.step_id != self._report_step or finished:
            return []
        total = sum(loss for loss, _ in self._losses.values())
        count = sum(n for _, n in self._losses.values())
        metrics: dict[str, float] = {}
        if self._metrics_of is not None and self._batch is not None:
            metrics = self._metrics_of(self._batch, self._losses)
            total, count = metrics["valid_loss"], 1
        self._losses.clear()
        self._batch = None
        return [JobEvent(self.spec.job_id, JobEventKind.VALIDATION, position.step,
                         loss=total / max(1, count), num_tokens=count, metrics=metrics,
                         message=f"validation loss after step {position.step}")]
