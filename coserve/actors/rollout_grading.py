"""The scheduler's grading of reinforcement jobs' rollouts: decoded with the engine's tokenizer, graded on a
pool of worker threads (`graders.rollout_grading.RolloutGrader`), python graders in limited child processes
when the operator turned them on (`--enable-python-graders`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from coserve.contract.sampling import EosIds
from coserve.frontend.tokenizer import Tokenizer
from coserve.graders.python_grader import PythonGraderRunner
from coserve.graders.rollout_grading import RolloutGrader

GRADING_THREADS = 4  # a python grader's sample waits for one of the runner's slots on its thread


def rollout_grading(tokenizer: Tokenizer, model_eos_ids: Sequence[int], python_graders: bool,
                    wake: Callable[[], None]) -> tuple[RolloutGrader, EosIds]:
    """The grader of the scheduler's rollouts and the ids sampling stops on; `wake` is called from a worker
    thread when a batch is graded."""
    python = PythonGraderRunner() if python_graders else None
    executor = ThreadPoolExecutor(GRADING_THREADS, thread_name_prefix="coserve-grading")
    grader = RolloutGrader(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True), python, executor,
                           on_done=wake)
    return grader, EosIds.resolve(tokenizer, model_eos_ids)
