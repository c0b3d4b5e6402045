"""A fine-tuning job's validation passes, as the scheduler runs them: after each epoch that ends with a
checkpoint, every validation example runs forward only (no gradient, no optimizer step); the windows'
reported losses are summed per sequence, and once the pass's last window has run, one validation event
gives the mean token loss (a DPO job's: the pairs' DPO loss and rewards, `preference_batches`). Pure
Python."""

from __future__ import annotations

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind, trained_tokens
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.finetune.preference_batches import preference_batch, validation_metrics
from coserve.finetune.progress import BatchProgress, SequenceProgress


class ValidationPass:
    """The validation of one job: the pass to run next, and the losses of the one in flight."""

    def __init__(self, spec: FinetuneJobSpec) -> None:
        self.spec = spec
        self.pending = False  # an epoch ended: evaluate the validation set next
        self._losses: dict[str, tuple[float, int]] = {}  # validation sequence -> (sum, tokens)
        self._report_step = -1  # plan whose result completes the pass
        self._batch: BatchProgress | None = None  # the pass whose metrics are pending

    def batch(self, position: DataPosition) -> BatchProgress:
        """The pass's sequences (forward only), for the data position it validates."""
        spec, examples = self.spec, self.spec.validation_examples
        prefix = f"{spec.job_id}/v{position.step}"
        if spec.is_preference:
            return preference_batch(spec, position, list(range(len(examples))), {}, prefix, evaluation=True)
        sequences = []
        for k, example in enumerate(examples):
            seq = SequenceProgress(f"{prefix}.{k}", k, len(example.token_ids), spec.num_layers, group=k)
            seq.reset()
            sequences.append(seq)
        normalizer = max(1, sum(trained_tokens(e) for e in examples))
        return BatchProgress(after=position, normalizer=normalizer, sequences=sequences, evaluation=True)

    def planned(self, batch: BatchProgress, plan: IterationPlan) -> None:
        """The pass's last window is in `plan`: its result completes the pass."""
        self._report_step, self._batch = plan.step_id, batch

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
        if self.spec.is_preference and self._batch is not None:
            metrics = validation_metrics(self._batch, self._losses, self.spec.loss.beta)
            total, count = metrics["valid_loss"], 1
        self._losses.clear()
        self._batch = None
        return [JobEvent(self.spec.job_id, JobEventKind.VALIDATION, position.step,
                         loss=total / max(1, count), num_tokens=count, metrics=metrics,
                         message=f"validation loss after step {position.step}")]
