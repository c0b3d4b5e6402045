"""The scheduler's grading of reinforcement jobs' rollouts: decoded with the engine's tokenizer, graded on a
pool of worker threads shared fairly between tenants (`graders.rollout_grading.RolloutGrader` on a
`graders.fair_pool.FairPool`), python graders in their sandbox when the operator turned them on
(`--enable-python-graders`), model graders judged by the models this server serves (`actors.rollout_judges`)."""

from __future__ import annotations

from collections.abc import Callable

from coserve.contract.sampling import EosIds
from coserve.frontend.tokenizer import Tokenizer
from coserve.graders.fair_pool import FairPool
from coserve.graders.python_grader import PythonGraderRunner
from coserve.graders.rollout_grading import Judge, RolloutGrader

GRADING_THREADS = 8  # a python grader's sample waits for a runner slot, a model grader's for its judge, on its thread
# A tenant's samples take at most half of them at once: metrics hold the GIL in the scheduler's process, so
# one job's CPU-bound grading may not crowd the others' (nor the scheduler's loop) out.
FIRST_UID = 60500  # the scheduler's python grader sandboxes run as uids 60500.. (the gateway's: 60000..)


def grading_pool() -> FairPool:
    """The scheduler's grading threads (started when first used; shut down with the scheduler)."""
    return FairPool(GRADING_THREADS, per_tenant=GRADING_THREADS // 2, name="coserve-grading")


def rollout_grading(tokenizer: Tokenizer, eos: EosIds, python_graders: bool, wake: Callable[[], None],
                    judges: Judge, executor: FairPool) -> RolloutGrader:
    """The grader of the scheduler's rollouts on `executor`; `wake` is called from a worker thread when a
    batch is graded; `judges` asks model graders' judges (`actors.rollout_judges`)."""
    python = PythonGraderRunner(first_uid=FIRST_UID) if python_graders else None
    return RolloutGrader(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True), python, executor,
                         on_done=wake, judges=judges)
