"""The scheduler's grading of reinforcement jobs' rollouts: decoded with the engine's tokenizer, graded on a
pool of worker threads (`graders.rollout_grading.RolloutGrader`), python graders in limited child processes
when the operator turned them on (`--enable-python-graders`), model graders judged by the models this server
serves (`actors.rollout_judges`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from coserve.contract.sampling import EosIds
from coserve.frontend.tokenizer import Tokenizer
from coserve.graders.python_grader import PythonGraderRunner
from coserve.graders.rollout_grading import Judge, RolloutGrader

GRADING_THREADS = 8  # a python grader's sample waits for a runner slot, a model grader's for its judge, on its thread


def grading_pool() -> ThreadPoolExecutor:
    """The scheduler's grading threads (started when first used; shut down with the scheduler)."""
    return ThreadPoolExecutor(GRADING_THREADS, thread_name_prefix="coserve-grading")


def rollout_grading(tokenizer: Tokenizer, eos: EosIds, python_graders: bool, wake: Callable[[], None],
                    judges: Judge, executor: ThreadPoolExecutor) -> RolloutGrader:
    """The grader of the scheduler's rollouts on `executor`; `wake` is called from a worker thread when a
    batch is graded; `judges` asks model graders' judges (`actors.rollout_judges`)."""
    python = PythonGraderRunner() if python_graders else None
    return RolloutGrader(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True), python, executor,
                         on_done=wake, judges=judges)
