"""`RolloutGrader`: a reinforcement job's completions decoded and graded (`grading.grade`), the
`RolloutGrading` the rollout loop asks (`coserve.contract.reinforcement`).

On a server each sample is graded on a worker thread of the grader's `FairPool`, so the scheduler's loop
never waits for a metric or a python grader's sandbox; the pool takes tenants' samples least grading time
first (a job's big batch does not hold another tenant's samples behind it), and a python grader's sample
waits on its thread for a sandbox slot, which `PythonGraderRunner` also shares between tenants by time.
`on_done` is called, on a worker thread, when a batch's last sample is graded (the scheduler wakes its
loop with it). The scheduler's grader (`scheduler_grader`) runs on `grading_pool`'s threads, its python
graders in sandboxes of uids of their own. Without an executor (offline), grading runs on the caller's
thread and the future is done when `grade` returns. A grader that raises is a sample scored 0 with its
error, never a failed future. Model graders (`score_model`) are judged by `judges` (the
server's: `graders.rollout_judges`), asked as the job's tenant on the sample's worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from coserve.contract.grader import Grader, ModelGrader
from coserve.contract.reinforcement import GradedSample
from coserve.graders.fair_pool import FairPool
from coserve.graders.grading import grade
from coserve.graders.judging import Judgement, model_graders
from coserve.graders.python_grader import PythonGraderRunner

# (tenant, model grader, row, sample text) -> the judge's verdict (None: a template could not be rendered)
Judge = Callable[[str, ModelGrader, Mapping[str, Any], str], Judgement | None]

GRADING_THREADS = 8  # a python grader's sample waits for a runner slot, a model grader's for its judge, on its thread
# A tenant's samples take at most half of them at once: metrics hold the GIL in the scheduler's process, so
# one job's CPU-bound grading may not crowd the others' (nor the scheduler's loop) out.
FIRST_UID = 60500  # the scheduler's python grader sandboxes run as uids 60500.. (the gateway's: 60000..)


class RolloutGrader:
    """Grades completions for a job's rows (module docstring).

    Args:
        decode: token ids -> the text graders see (special tokens skipped).
        python: runs python graders; None: a python grader's samples fail (checked at job creation).
        executor: where samples are graded, fairly between tenants (None: on the caller's thread).
        on_done: called when a batch is graded.
        judges: asks model graders' judges (None: a model grader's samples fail, checked at job creation).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], python: PythonGraderRunner | None = None,
                 executor: FairPool | None = None, on_done: Callable[[], None] | None = None,
                 judges: Judge | None = None) -> None:
        self._decode, self._python, self._executor, self._on_done = decode, python, executor, on_done
        self._judges = judges

    def grade(self, tenant: str, grader: Grader, items: Sequence[Mapping[str, Any]],
              completions: Sequence[Sequence[int]]) -> Future[list[GradedSample]]:
        if len(items) != len(completions):
            raise ValueError("one row per completion")
        combined: Future[list[GradedSample]] = Future()
        if self._executor is None or not completions:
            combined.set_result([self._one(tenant, grader, i, c) for i, c in zip(items, completions, strict=True)])
            return combined
        futures = [self._executor.submit(tenant, self._one, tenant, grader, i, c)
                   for i, c in zip(items, completions, strict=True)]
        remaining, lock = [len(futures)], threading.Lock()

        def finished(_: Future[GradedSample]) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                combined.set_result([f.result() for f in futures])
                if self._on_done is not None:
                    self._on_done()

        for future in futures:
            future.add_done_callback(finished)
        return combined

    def _one(self, tenant: str, grader: Grader, item: Mapping[str, Any], completion: Sequence[int]) -> GradedSample:
        try:
            text = self._decode(completion)
            judged = {}
            if self._judges is not None:
                for judge, _ in model_graders(grader):
                    verdict = self._judges(tenant, judge, item, text)
                    if verdict is not None:
                        judged[id(judge)] = verdict
            result = grade(grader, item, text, self._python, tenant=tenant, judged=judged)
        except Exception as err:  # noqa: BLE001 - one sample's grader bug is that sample's 0, not a lost batch
            return GradedSample(0.0, {}, f"the grader raised {type(err).__name__}: {err}")
        error = None
        if result.errors.any:
            error = "; ".join(result.errors.details) or "the grader flagged an error"
        return GradedSample(result.reward, dict(result.sub_rewards), error)


def grading_pool() -> FairPool:
    """The scheduler's grading threads (started when first used; shut down with the scheduler)."""
    return FairPool(GRADING_THREADS, per_tenant=GRADING_THREADS // 2, name="coserve-grading")


def scheduler_grader(decode: Callable[[Sequence[int]], str], python_graders: bool, wake: Callable[[], None],
                     judges: Judge, executor: FairPool) -> RolloutGrader:
    """The grader of the scheduler's rollouts on `executor`; `wake` is called from a worker thread when a
    batch is graded; `judges` asks model graders' judges (`graders.rollout_judges`); python graders run only
    when the operator turned them on (`--enable-python-graders`)."""
    python = PythonGraderRunner(first_uid=FIRST_UID) if python_graders else None
    return RolloutGrader(decode, python, executor, on_done=wake, judges=judges)
