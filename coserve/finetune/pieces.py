"""`JobPieces`: one fine-tuning job beside a policy that plans no fine-tuning, given the piece its driver
chooses for each iteration (calibration's sweep, the profiler, `benchmarks/finetune_pieces.py`).

It is an `EngineCore` `JobSide`: the core calls `schedule` on each plan the policy made and `update`
with each result, so a driver only sets `budget` before `EngineCore.step`.
"""

from __future__ import annotations

from coserve.contract.plan import IterationPlan, IterationResult
from coserve.finetune.job import CoservedJob


class JobPieces:
    """A fine-tuning job given the piece its driver sets before each step: `budget` is (forward
    tokens, backward token-layers), None for no piece. `cancel` cancels the job in the next plan.

    Args:
        job: the job (allocating from the policy's KV blocks and adapter slots).
    """

    def __init__(self, job: CoservedJob) -> None:
        self._job = job
        self.budget: tuple[int, int] | None = None
        self._cancel = False

    @property
    def job(self) -> CoservedJob:
        return self._job

    def cancel(self) -> None:
        """Cancel the job in the next plan (and give it no more pieces)."""
        self._cancel, self.budget = True, None

    def schedule(self, plan: IterationPlan) -> None:
        if self._cancel:
            self._job.cancel(plan)
            self._cancel = False
        elif self.budget is not None:
            self._job.schedule(plan, *self.budget)

    def update(self, plan: IterationPlan, result: IterationResult) -> None:
        self._job.update(plan, result)
