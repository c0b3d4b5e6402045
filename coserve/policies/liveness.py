"""Liveness of fine-tuning: every runnable job makes progress, or the policy says why not.

A co-serving policy gives fine-tuning what inference leaves (the hybrid policy: what its latency model
says fits under the TPOT SLO). Under a tight SLO, a tiny token budget, a slow machine or a wrong latency
model that can be nothing, iteration after iteration: the job would sit in `running` forever. This is
the rule that forbids it:

- **Floor.** When a runnable job has had no work in the last `every` plans, the next plan keeps
  `tokens` of the iteration's token budget away from inference and gives one piece (a forward window of
  at most `tokens` tokens, or backward tasklets of at most `tokens` token-layers) to the job that has
  waited longest, whatever the SLO, the waiting queue, the TTFT guard or the virtual token counters say
  (the counters are charged as usual). So with n runnable jobs each moves at least once every
  `every` + n iterations, and the cost is bounded: at most n iterations in `every` + n are longer by
  one small piece each.
- **Why not.** Each plan that gives runnable jobs nothing records the reason (`held_back`), which the
  scheduler's watchdog writes as a job event when a job has not moved for a while.

What can still stop a job is memory: a job whose piece finds no free KV block or adapter slot (inference
holds them; training borrows memory, inference owns it) waits, and `held_back` says so.
"""

from __future__ import annotations

from collections.abc import Iterable

from coserve.contract.plan import IterationPlan
from coserve.contract.training_plan import TrainingWork
from coserve.policies.job_roster import Allowance, TrainingJob, fixed_allowance

NO_MEMORY = "held back: no free KV block or adapter slot for its next piece (inference holds them)"


def _has_work(training: TrainingWork) -> bool:
    return bool(training.forward_windows or training.backward_tasklets)


class FinetuneFloor:
    """Forces a small piece for a job that has had no work in `every` plans; says why jobs wait.

    Args:
        every: plans a runnable job may go without work before the next one carries its piece (>= 1).
        tokens: the floor piece's size: forward tokens, or backward token-layers (>= 1).
        max_batch_tokens: the iteration's token budget (inference and forward windows share it).
    """

    def __init__(self, every: int, tokens: int, max_batch_tokens: int) -> None:
        if every < 1 or tokens < 1:
            raise ValueError(f"the fine-tuning floor needs every >= 1 and tokens >= 1, got {every}, {tokens}")
        self.every = every
        self.tokens = tokens
        # Forward windows share the token budget with inference: the floor takes at most half of it.
        self._forward_tokens = max(1, min(tokens, max_batch_tokens // 2))
        self.held_back: str | None = None  # why the last plan gave runnable jobs nothing
        self._reason: str | None = None  # what the allowance said in the plan being built
        self._first_seen: dict[str, int] = {}  # job id -> step id of the first plan that saw it

    def due(self, step_id: int, jobs: Iterable[TrainingJob]) -> bool:
        """Whether the plan `step_id` must carry a floor piece: a runnable job had no work in the last
        `every` plans (a job that never had any counts from the first plan that saw it)."""
        first_seen, due = {}, False
        for job in jobs:
            first_seen[job.job_id] = self._first_seen.get(job.job_id, step_id)
            last = job.last_planned_step if job.last_planned_step >= 0 else first_seen[job.job_id] - 1
            due = due or (job.runnable and step_id - last > self.every)
        self._first_seen = first_seen  # finished jobs drop out
        return due

    def reserved_tokens(self, due: bool) -> int:
        """Tokens of the budget inference must leave to fine-tuning in the plan being built."""
        return self._forward_tokens if due else 0

    def hold(self, reason: str, *, unless_said: bool = False) -> None:
        """Record why the allowance gives fine-tuning nothing in the plan being built (with
        `unless_said`, only when no more specific reason was recorded)."""
        if not (unless_said and self._reason):
            self._reason = reason

    def allowance(self, inference_tokens: int, max_batch_tokens: int) -> Allowance:
        """One piece of at most the floor's size (for `JobRoster.fill_longest_waiting`)."""
        room = max(0, min(self._forward_tokens, max_batch_tokens - inference_tokens))
        return fixed_allowance(room, self.tokens)

    def after_plan(self, plan: IterationPlan, has_runnable: bool) -> None:
        """Note why the plan gave runnable jobs nothing (`held_back`), or that it gave them work."""
        starved = has_runnable and not _has_work(plan.training)
        self.held_back = (self._reason or NO_MEMORY) if starved else None
        self._reason = None
