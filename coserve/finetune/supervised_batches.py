"""A supervised job's batches (`BatchSource`): its examples in its data order (`DataPosition.next_batch`),
`batch_size` a batch, one sequence per example, each trained alone and normalized by the batch's trained
tokens; an optimizer step ends each batch, and the job's data is done after `n_epochs`. Its validation
pass runs every validation example forward. Pure Python."""

from __future__ import annotations

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import FinetuneJobSpec, trained_tokens
from coserve.contract.plan import IterationPlan
from coserve.contract.training_plan import TrainingExample
from coserve.finetune.batch_source import BatchSource, NoBatch, SourceJob
from coserve.finetune.progress import BatchProgress, SequenceProgress


def example_batch(examples: list[TrainingExample], indices: list[int], prefix: str, num_layers: int,
                  after: DataPosition, evaluation: bool = False) -> BatchProgress:
    """The batch of `examples[indices]` that leads to `after`: one sequence per example, each a group of
    its own (`{prefix}.{k}`), normalized by the batch's trained tokens."""
    sequences = []
    for k, index in enumerate(indices):
        seq = SequenceProgress(f"{prefix}.{k}", index, len(examples[index].token_ids), num_layers, group=k)
        seq.reset()
        sequences.append(seq)
    normalizer = sum(trained_tokens(examples[i]) for i in indices)
    return BatchProgress(after=after, normalizer=max(1, normalizer) if evaluation else normalizer,
                         sequences=sequences, evaluation=evaluation)


class SupervisedBatches(BatchSource):
    """The batches of one supervised job (module docstring)."""

    def __init__(self, spec: FinetuneJobSpec) -> None:
        self.spec = spec

    def next_batch(self, job: SourceJob, plan: IterationPlan) -> BatchProgress | NoBatch:
        spec = self.spec
        if job.position.epoch >= spec.n_epochs:
            return NoBatch.DONE
        indices, after = job.position.next_batch(len(spec.examples), spec.batch_size)
        return example_batch(spec.examples, indices, f"{spec.job_id}/s{after.step}", spec.num_layers, after)

    def batch_planned(self, batch: BatchProgress, plan: IterationPlan) -> bool:
        return True

    def validation_batch(self, position: DataPosition) -> BatchProgress:
        """The validation pass after `position`: every validation example, forward only."""
        examples = self.spec.validation_examples
        return example_batch(examples, list(range(len(examples))), f"{self.spec.job_id}/v{position.step}",
                             self.spec.num_layers, position, evaluation=True)
