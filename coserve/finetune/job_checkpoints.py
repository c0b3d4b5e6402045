"""The last confirmed checkpoint of each running job, and the spec that resumes a job from it.

A job whose engine is lost resumes on another engine from its last checkpoint (`EngineCluster`'s
failover). A checkpoint counts once the engine confirmed the save (`IterationResult.training.saved`);
what it holds comes from the plan's `SaveAdapter`: the data position after its step and the trained
tokens up to it, so the resumed job takes the same batches next and its count goes on from there (as
a job resumed after a server restart does, `jobs/resume.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import FinetuneJobSpec, trained_tokens_before
from coserve.contract.plan import IterationPlan, IterationResult


@dataclass(frozen=True, slots=True)
class JobCheckpoint:
    """A resumable checkpoint: its folder, step, data position and the job's trained tokens then."""

    path: str
    step: int
    position: DataPosition
    trained_tokens: int
    reference_logprobs: dict[int, tuple[float, float]]  # a DPO job's reference sums then


class JobCheckpoints:
    """Job id -> its last confirmed resumable checkpoint."""

    def __init__(self) -> None:
        self._last: dict[str, JobCheckpoint] = {}

    def observe(self, plan: IterationPlan, result: IterationResult,
                specs: dict[str, FinetuneJobSpec]) -> list[JobCheckpoint]:
        """Keep the checkpoints `result` confirms for the saves `plan` asked for (final saves are not
        resumable and are not kept); `specs` are the jobs' specs by id. Returns the new ones."""
        saves = {(s.job_id, s.path): s for s in plan.training.saves if s.position is not None}
        new = []
        for saved in result.training.saved:
            save = saves.get((saved.job_id, saved.path))
            spec = specs.get(saved.job_id)
            if save is None or save.position is None or spec is None:
                continue
            position = DataPosition.from_dict(save.position)
            tokens = save.trained_tokens
            if tokens is None:
                tokens = trained_tokens_before(spec, position)
            checkpoint = JobCheckpoint(saved.path, saved.step, position, tokens,
                                       dict(save.reference_logprobs or {}))
            self._last[saved.job_id] = checkpoint
            new.append(checkpoint)
        return new

    def last(self, job_id: str) -> JobCheckpoint | None:
        return self._last.get(job_id)

    def forget(self, job_id: str) -> None:
        """The job ended: nothing to resume."""
        self._last.pop(job_id, None)

    def resume_spec(self, spec: FinetuneJobSpec) -> FinetuneJobSpec:
        """`spec` resuming from the job's last checkpoint; unchanged when it has none (it starts over:
        the lost engine's progress since the start, or since the checkpoint the spec resumed from, is
        redone)."""
        checkpoint = self._last.get(spec.job_id)
        if checkpoint is None:
            return spec
        return replace(spec, resume_from=checkpoint.path, start_position=checkpoint.position,
                       start_trained_tokens=checkpoint.trained_tokens,
                       reference_logprobs={**spec.reference_logprobs, **checkpoint.reference_logprobs})
