"""One batch of a co-served job in flight, planned sequence by sequence: each sequence's forward windows
(within the forward budget and the job's `max_window_tokens`, in KV blocks the job allocates: `sequence_kv`),
then its backward tasklets (layer-major: last layer first, last tokens first, within the backward budget);
a DPO pair's two trained sequences run both forwards before either backward. A sequence starts with what its
batch's source says it carries (`BatchSource.start_terms`). When inference needs KV blocks, the sequences in
flight are dropped and redone (`release`). Pure Python."""

from __future__ import annotations

from coserve.contract.job_spec import FinetuneJobSpec, JobPhase
from coserve.contract.plan import IterationPlan
from coserve.contract.training_plan import ForwardWindow, SequenceStart
from coserve.finetune.batch_source import BatchSource
from coserve.finetune.progress import BatchProgress, SequenceProgress
from coserve.finetune.sequence_kv import SequenceKV
from coserve.tenancy.vtc import backward_tasklet_tokens


class BatchRun:
    """The batch `batch` from `source`, its sequences planned one after the other (module docstring).

    Args:
        spec: the job (its id, window and tasklet sizes).
        kv: the job's sequences' KV blocks.
    """

    def __init__(self, spec: FinetuneJobSpec, batch: BatchProgress, source: BatchSource, kv: SequenceKV) -> None:
        self.spec, self.batch, self.source, self._kv = spec, batch, source, kv
        self.too_long: SequenceProgress | None = None  # a sequence that can never get its KV blocks

    @property
    def done(self) -> bool:
        """Every sequence's last work is planned."""
        return self.batch.current >= len(self.batch.sequences)

    def current(self) -> SequenceProgress | None:
        return None if self.done else self.batch.sequences[self.batch.current]

    def forward_target(self, seq: SequenceProgress) -> SequenceProgress | None:
        """The sequence whose forward comes next while `seq` is current: `seq` itself, or (a DPO pair)
        the next of its group whose forward is not done; None when the group's forwards are all done."""
        if seq.forward_end < seq.length or self.batch.forward_only(seq):
            return seq if seq.forward_end < seq.length else None
        return next((s for s in self.batch.group_of(seq) if s.forward_end < s.length), None)

    @property
    def phase(self) -> JobPhase:
        seq = self.current()
        return JobPhase.BACKWARD if seq is not None and self.forward_target(seq) is None else JobPhase.FORWARD

    @property
    def layer_tokens(self) -> tuple[int, int]:
        """Backward tokens left in the layer whose tasklets come next, and in a whole layer ((0, 0)
        outside the backward phase)."""
        seq = self.current()
        return (seq.layer_end[seq.layer], seq.length) if seq is not None and self.phase is JobPhase.BACKWARD else (0, 0)

    def schedule(self, plan: IterationPlan, forward_tokens: int,
                 backward_token_layers: int) -> tuple[float, tuple[SequenceProgress, ...]]:
        """Plan the current sequence's next work; returns the tokens to charge and the sequences it moved.
        A sequence whose forward completes here may start its backward in the same plan (the engine runs
        tasklets after the forward)."""
        seq = self.current()
        assert seq is not None
        charged = 0.0
        target = self.forward_target(seq)
        if target is not None:
            charged += self._forward(plan, target, seq, forward_tokens)
        if seq.forward_end == seq.length and self.batch.forward_only(seq):
            self._complete_sequence()  # the engine drops it after its forward
        elif self.forward_target(seq) is None:
            charged += self._backward(plan, seq, backward_token_layers)
        return charged, (seq,) if target is None or target is seq else (target, seq)

    def _forward(self, plan: IterationPlan, seq: SequenceProgress, lead: SequenceProgress, budget: int) -> float:
        """One window of `seq` (the current sequence `lead`, or the next of its DPO pair)."""
        count = min(budget, self.spec.max_window_tokens, seq.length - seq.forward_end)
        if count < 1:
            return 0.0
        if not self._kv.allocate(seq, lead, seq.forward_end + count):
            if self._kv.never_fits(seq):
                self.too_long = seq
            return 0.0
        if not seq.started and not self._start_sequence(plan, seq):
            self._kv.free_now(seq.sequence_id)
            return 0.0
        plan.training.forward_windows.append(ForwardWindow(
            seq.sequence_id, seq.forward_end, count, self._kv.table(seq.sequence_id)))
        seq.forward_end += count
        return float(count)

    def _start_sequence(self, plan: IterationPlan, seq: SequenceProgress) -> bool:
        """Send the sequence's start; False while its source says it cannot start yet."""
        batch = self.batch
        terms = self.source.start_terms(batch, seq)
        if terms is None:
            return False
        plan.training.sequence_starts.append(SequenceStart(
            seq.sequence_id, self.spec.job_id, seq.example_index, terms.normalizer, evaluate=batch.evaluation,
            rejected=seq.rejected, reference=seq.reference, pair=terms.pair, example=seq.example,
            inputs=seq.inputs, loss=seq.loss, report_logprobs=seq.report_logprobs,
            marks_gradient=seq.marks_gradient))
        seq.started = True
        return True

    def _backward(self, plan: IterationPlan, seq: SequenceProgress, budget: int) -> float:
        """Layer-major tasklets (last layer first, last tokens first) within `budget` token-layers."""
        tasklets = seq.take_backward(budget, self.spec.min_tasklet_tokens)
        plan.training.backward_tasklets.extend(tasklets)
        if seq.backward_done:
            self._complete_sequence()
        return sum(backward_tasklet_tokens(t.end - t.start, 1, seq.num_layers) for t in tasklets)

    def _complete_sequence(self) -> None:
        """The sequence's last work is planned: its blocks are freed after the step; the next one is current."""
        self._kv.done(self.batch.sequences[self.batch.current])
        self.batch.current += 1

    def release(self, plan: IterationPlan) -> int:
        """Drop the sequences in flight to free their KV blocks; returns the blocks freed. Refused (0) for a
        DPO pair once a backward of it has started (its gradient is then part-way into the adapter's), and
        for a sequence dropped `MAX_DROPS` times in a row already (it keeps its blocks: `sequence_kv`)."""
        group = self.batch.in_flight()
        if len(group) > 1 and any(s.layer_end != [s.length] * s.num_layers for s in group):
            return 0
        freed = self._kv.release(group, plan)
        for member in group if freed else ():
            if member.started:
                self.source.redo(member.sequence_id)
                member.reset()
        return freed
