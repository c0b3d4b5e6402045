"""A DPO job's batches, as the scheduler runs them: per pair, its reference passes (unless known) and its
two trained sequences; and the reference sums, collected from the windows' reports. Pure Python.

A pair's sequences run in this order: the chosen and rejected reference passes (forward only, through
the base model: the adapter is switched off in the same engine, so the reference costs no second copy
of the weights), then both trained sequences' forwards, then both backwards (the pair's DPO coefficient
needs both forward sums: the engine scales the two gradients between the forwards and the backwards).
Reference passes are fine-tuning forward tokens like any other: the policy and the tenant's virtual
token counter charge them. Each pair's reference sums are computed once: the job keeps them for later
epochs and its checkpoints keep them for a resume.

A validation batch runs all four of each pair's sequences forward only, and reports the pairs' DPO loss
and reward accuracy (`validation_metrics`). `PreferenceBatches` is a DPO job's `BatchSource`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import FinetuneJobSpec, trained_tokens, unit_tokens
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.preference import PairLogprobs
from coserve.contract.preference import validation_metrics as pair_validation_metrics
from coserve.contract.training_plan import PairStart, TrainingExample
from coserve.finetune.batch_source import BatchSource, NoBatch, SourceJob, StartTerms
from coserve.finetune.progress import BatchProgress, SequenceProgress


def _sequence(sequence_id: str, index: int, example: TrainingExample, num_layers: int, *, rejected: bool,
              reference: bool, group: int) -> SequenceProgress:
    seq = SequenceProgress(sequence_id, index, len(example.token_ids), num_layers, rejected=rejected,
                           reference=reference, group=group)
    seq.reset()
    return seq


def preference_batch(spec: FinetuneJobSpec, after: DataPosition, indices: list[int],
                     references: dict[int, tuple[float, float]], prefix: str,
                     evaluation: bool = False) -> BatchProgress:
    """The sequences of the pairs `indices` (validation pairs when `evaluation`)."""
    chosen = spec.validation_examples if evaluation else spec.examples
    rejected = spec.validation_rejected if evaluation else spec.rejected_examples
    sequences = []
    for k, index in enumerate(indices):
        sides = ((False, chosen[index], "c"), (True, rejected[index], "r"))
        if evaluation or index not in references:
            sequences += [_sequence(f"{prefix}.{k}{tag}-ref", index, example, spec.num_layers,
                                    rejected=is_rejected, reference=True, group=k)
                          for is_rejected, example, tag in sides]
        sequences += [_sequence(f"{prefix}.{k}{tag}", index, example, spec.num_layers,
                                rejected=is_rejected, reference=False, group=k)
                      for is_rejected, example, tag in sides]
    normalizer = sum(trained_tokens(chosen[i]) + trained_tokens(rejected[i]) for i in indices) \
        if evaluation else sum(unit_tokens(spec, i) for i in indices)
    return BatchProgress(after=after, normalizer=normalizer, sequences=sequences, evaluation=evaluation,
                         pairs=list(indices))


def pair_start(batch: BatchProgress, seq: SequenceProgress,
               references: dict[int, tuple[float, float]]) -> PairStart | None:
    """The `PairStart` of a trained sequence of a DPO batch; None while its references are not known."""
    known = references.get(seq.example_index)
    if known is None:
        return None
    partner = next(s for s in batch.group_of(seq) if s is not seq)
    return PairStart(partner.sequence_id, chosen=not seq.rejected, reference_chosen=known[0],
                     reference_rejected=known[1], pairs_in_batch=len(batch.pairs))


@dataclass(slots=True)
class ReferenceSums:
    """The reference passes' sums as their windows report them, per sequence until it is complete."""

    known: dict[int, tuple[float, float]]  # pair index -> (chosen, rejected): complete pairs
    _partial: dict[str, tuple[int, bool, float, int, int]] = field(default_factory=dict)
    _sides: dict[int, dict[bool, float]] = field(default_factory=dict)

    def expect(self, seq: SequenceProgress, expected_tokens: int) -> None:
        """A reference pass starts: collect its windows (again, if it was dropped and is redone)."""
        self._partial[seq.sequence_id] = (seq.example_index, seq.rejected, 0.0, 0, expected_tokens)

    def add(self, sequence_id: str, logprob_sum: float, num_tokens: int) -> None:
        entry = self._partial.get(sequence_id)
        if entry is None:
            return
        index, is_rejected, total, count, expected = entry
        total, count = total + logprob_sum, count + num_tokens
        if count < expected:
            self._partial[sequence_id] = (index, is_rejected, total, count, expected)
            return
        del self._partial[sequence_id]
        sides = self._sides.setdefault(index, {})
        sides[is_rejected] = total
        if len(sides) == 2:
            self.known[index] = (sides[False], sides[True])
            del self._sides[index]


def validation_metrics(batch: BatchProgress, sums: dict[str, tuple[float, int]],
                       beta: float) -> dict[str, float]:
    """The validation pairs' DPO loss and rewards from their four sequences' summed log-probs."""
    by_role = {(s.group, s.rejected, s.reference): sums.get(s.sequence_id, (0.0, 0))[0]
               for s in batch.sequences}  # one pass: a validation set may hold thousands of pairs
    records = [PairLogprobs(by_role[(k, False, False)], by_role[(k, True, False)],
                            by_role[(k, False, True)], by_role[(k, True, True)])
               for k in range(len(batch.pairs))]
    return pair_validation_metrics(records, beta)


class PreferenceBatches(BatchSource):
    """A DPO job's batches and its reference sums (module docstring)."""

    def __init__(self, spec: FinetuneJobSpec) -> None:
        self.spec = spec
        self._references = ReferenceSums(dict(spec.reference_logprobs))

    def next_batch(self, job: SourceJob, plan: IterationPlan) -> BatchProgress | NoBatch:
        spec = self.spec
        if job.position.epoch >= spec.n_epochs:
            return NoBatch.DONE
        indices, after = job.position.next_batch(len(spec.examples), spec.batch_size)
        return preference_batch(spec, after, indices, self._references.known, f"{spec.job_id}/s{after.step}")

    def batch_planned(self, batch: BatchProgress, plan: IterationPlan) -> bool:
        return True

    def start_terms(self, batch: BatchProgress, seq: SequenceProgress) -> StartTerms | None:
        """A trained sequence's pair (None until its references are known); a reference pass is collected.
        The normalizer is 1: DPO's coefficient has the batch's mean."""
        pair = None
        if not batch.forward_only(seq):
            pair = pair_start(batch, seq, self._references.known)
            if pair is None:
                return None
        if seq.reference and not batch.evaluation:
            examples = self.spec.rejected_examples if seq.rejected else self.spec.examples
            self._references.expect(seq, trained_tokens(examples[seq.example_index]))
        return StartTerms(pair, 1)

    def update(self, plan: IterationPlan, result: IterationResult) -> None:
        for window in result.training.windows:
            self._references.add(window.sequence_id, window.loss_sum, window.num_tokens)

    def checkpoint_state(self) -> dict[int, tuple[float, float]] | None:
        return dict(self._references.known)

    def validation_batch(self, position: DataPosition) -> BatchProgress:
        """The validation pass after `position`: every validation pair's four sequences, forward only."""
        spec = self.spec
        return preference_batch(spec, position, list(range(len(spec.validation_examples))), {},
                                f"{spec.job_id}/v{position.step}", evaluation=True)

    def validation_metrics(self, batch: BatchProgress, sums: dict[str, tuple[float, int]]) -> dict[str, float]:
        return validation_metrics(batch, sums, self.spec.loss.beta)
