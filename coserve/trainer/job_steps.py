"""A co-served job's optimizer step and saves on the engine, as `TrainingRuntime.run_after_forward` runs them
after the backward tasklets: the step over the batch's summed loss (a DPO batch's: its pairs' DPO loss and
rewards), and a checkpoint (atomic: the previous one stays) or the final PEFT adapter. Their errors are the
job's: the runtime fails the job with them, never the iteration."""

from __future__ import annotations

import shutil
from pathlib import Path

from coserve.contract.data_position import DataPosition
from coserve.contract.preference import dpo_metrics
from coserve.contract.training_plan import OptimizerStep, SaveAdapter, SavedAdapter, StepReport
from coserve.trainer.checkpoint import save_checkpoint
from coserve.trainer.job_state import TrainingJobState


def optimizer_step(job: TrainingJobState, planned: OptimizerStep) -> StepReport:
    """Step the job's optimizer over its batch, then start its next batch's sums.

    Raises:
        RuntimeError: the plan asks for a step the optimizer is not at.
        NonFiniteGradientError: the gradient is not finite (nothing was applied).
    """
    step, num_sequences, num_tokens = planned.step, planned.num_sequences, planned.num_tokens
    if step != job.optimizer.step_count + 1:
        raise RuntimeError(f"job {planned.job_id}: plan asks for step {step}, the optimizer has done "
                           f"{job.optimizer.step_count}")
    loss, metrics = job.batch_loss_sum / num_tokens, {}
    if job.batch_pairs:
        pairs, logprobs = zip(*job.batch_pairs, strict=True)
        metrics = dpo_metrics(list(pairs), list(logprobs)).as_dict()
        loss = metrics["train_loss"]
    stats = job.optimizer.step(loss=loss, num_sequences=num_sequences, num_tokens=num_tokens, adam=planned.adam)
    job.batch_loss_sum, job.batch_pairs = 0.0, []
    return StepReport(planned.job_id, stats.step, loss, stats.grad_norm, stats.learning_rate, num_sequences,
                      num_tokens, metrics)


def save_adapter(job: TrainingJobState, save: SaveAdapter) -> SavedAdapter:
    """Write a checkpoint (`save.position` set) or the final adapter.

    Raises:
        OSError: the write failed (disk full, permissions); a partial final adapter is removed first.
    """
    path = Path(save.path)
    try:
        if save.position is None:
            job.lora.save_pretrained(path, job.base_model_name_or_path)
        else:
            save_checkpoint(path, job.lora, job.optimizer, DataPosition.from_dict(save.position),
                            job.base_model_name_or_path, save.trained_tokens, save.reference_logprobs)
    except OSError:
        if save.position is None:
            shutil.rmtree(path, ignore_errors=True)
        raise
    return SavedAdapter(save.job_id, str(path), save.step)
