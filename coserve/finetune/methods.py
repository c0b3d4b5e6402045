"""A co-served job's training method, told apart once: its spec -> its `BatchSource` and its validation pass
(`batch_source`). A new method is a new source and one line here. Pure Python."""

from __future__ import annotations

from coserve.contract.job_spec import FinetuneJobSpec
from coserve.finetune.batch_source import BatchSource
from coserve.finetune.driven_ops import DrivenOps
from coserve.finetune.preference_batches import PreferenceBatches
from coserve.finetune.rollout_batches import FedBatches
from coserve.finetune.supervised_batches import SupervisedBatches
from coserve.finetune.validation_pass import ValidationPass


def batch_sources(spec: FinetuneJobSpec) -> tuple[BatchSource, ValidationPass]:
    """The source of the job's batches, by its method, and its validation passes."""
    if spec.driven:  # a run driven by its client's calls (the Tinker API)
        start_step = spec.start_position.step if spec.start_position is not None else 0
        return DrivenOps(spec.job_id, spec.output_dir, spec.num_layers, start_step), ValidationPass(spec)
    if spec.is_reinforcement:  # graded rollouts; its evaluations are its rollout loop's
        return FedBatches(spec), ValidationPass(spec)
    if spec.is_preference:
        pairs = PreferenceBatches(spec)
        return pairs, ValidationPass(spec, pairs.validation_batch, pairs.start_terms, pairs.validation_metrics)
    examples = SupervisedBatches(spec)
    return examples, ValidationPass(spec, examples.validation_batch)
