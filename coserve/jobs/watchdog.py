"""The fine-tuning watchdog: a running job that has not moved for a while gets an event saying why.

Liveness is a rule (`coserve.planner.liveness`): while a job is runnable, fine-tuning gets its minimum
share of the engine's time, or the policy records why it did not (`finetune_held_back`: no free KV
block, ...). What the rule cannot promise is that a job moves when memory is held by inference, or when
the machine is so slow that a job's next piece is minutes away. So the scheduler watches each job's
progress marker, which grows only with work that stays done (`finetune.kept_progress`: a sequence that
inference's KV reclaim drops and restarts does not move it until it gets past where it had been): a job
whose marker has not grown for `stall_after_s` seconds gets one job event ("No progress for 60 s: held
back: ...") and counts in the `coserve_finetune_jobs_stalled` gauge until it moves again, when a second
event says so. A job whose sequence was dropped and restarted `MAX_DROPS` times in a row (it then keeps
its KV blocks, `finetune.sequence_kv`) gets an event that says so, at most one per `stall_after_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coserve.contract.job_runner import SequenceRestarts
from coserve.finetune.sequence_kv import MAX_DROPS

DEFAULT_STALL_AFTER_S = 60.0
SLOW_ENGINE_PLANS = 8
"""A stalled job whose engine built at most this many plans meanwhile waits for the engine, not for
room in its plans: fine-tuning is owed its minimum share over every second, so an iteration longer than
that owes it a piece almost always, and the engine's jobs take the pieces in turns (up to this many)."""


@dataclass(slots=True)
class _Watch:
    progress: int  # the job's progress marker when last seen moving
    since: float  # when that was
    plan_step: int  # the engine's last plan then (-1: not known)
    stalled: bool = False


@dataclass(frozen=True, slots=True)
class StallNotice:
    """A job event to write: the job stopped moving (with why), or moved again."""

    job_id: str
    message: str
    stalled: bool


class JobWatchdog:
    """Tracks each running job's progress marker and says when one stops and restarts moving.

    Args:
        stall_after_s: seconds without progress before a job counts as stalled.
        clock: seconds (monotonic).
    """

    def __init__(self, stall_after_s: float = DEFAULT_STALL_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not stall_after_s > 0:
            raise ValueError(f"stall_after_s must be > 0, got {stall_after_s!r}")
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._watches: dict[str, _Watch] = {}
        self._restarts: dict[str, tuple[int, float]] = {}  # job id -> (kept sequences said, when)

    @property
    def stalled(self) -> int:
        """Running jobs that count as stalled now."""
        return sum(w.stalled for w in self._watches.values())

    def check(self, progress: Mapping[str, int], held_back: str | None,
              reasons: Mapping[str, str] | None = None,
              plan_steps: Mapping[str, int] | None = None) -> list[StallNotice]:
        """Compare each running job's progress marker (work that stays done: `RunningJob.progress_marker`;
        jobs that cannot run now, such as paused ones, are left out) with the last check's.

        Args:
            progress: job id -> progress marker, for the jobs that should be moving.
            held_back: the policy's latest reason for giving jobs no work (None: it gave them work).
            reasons: job id -> why that job is not moving, for jobs the policy does not plan (a
                dedicated Ray Train run); it replaces `held_back` for them.
            plan_steps: job id -> step id of the last plan of the job's engine (absent: not known), to
                tell a slow engine apart.
        """
        now = self._clock()
        notices = []
        watches = {}
        for job_id, marker in progress.items():
            plan_step = (plan_steps or {}).get(job_id, -1)
            watch = self._watches.get(job_id) or _Watch(marker, now, plan_step)
            if marker != watch.progress:
                if watch.stalled:
                    notices.append(StallNotice(job_id, "Training resumed", stalled=False))
                watch = _Watch(marker, now, plan_step)
            elif not watch.stalled and now - watch.since >= self.stall_after_s:
                watch.stalled = True
                why = (reasons or {}).get(job_id) or held_back or self._unplanned(watch, now, plan_step)
                notices.append(StallNotice(job_id, f"No progress for {now - watch.since:.0f} s: {why}",
                                           stalled=True))
            watches[job_id] = watch
        self._watches = watches
        return notices

    def check_restarts(self, restarts: Mapping[str, SequenceRestarts]) -> list[StallNotice]:
        """An event for each job with a sequence restarted `MAX_DROPS` times in a row since it was last
        said (at most one per `stall_after_s` per job); jobs left out are forgotten."""
        now = self._clock()
        notices, said = [], {}
        for job_id, seen in restarts.items():
            kept, when = self._restarts.get(job_id, (0, -float("inf")))
            if seen.kept < kept:  # the job started again on another engine: its count starts over
                kept = 0
            if seen.kept > kept and now - when >= self.stall_after_s:
                more = f" ({seen.kept} sequences so far)" if seen.kept > 1 else ""
                notices.append(StallNotice(job_id, (
                    f"A training sequence of {seen.tokens} tokens was dropped {MAX_DROPS} times in a row to free "
                    f"KV blocks for inference requests, restarting from its first token each time; it now keeps "
                    f"its blocks until it is done{more}"), stalled=False))
                kept, when = seen.kept, now
            said[job_id] = (kept, when)
        self._restarts = said
        return notices

    @staticmethod
    def _unplanned(watch: _Watch, now: float, plan_step: int) -> str:
        """Why a job the policy did not hold back got no work: a slow engine, or no room for its piece."""
        plans = plan_step - watch.plan_step
        if watch.plan_step >= 0 and 0 <= plans <= SLOW_ENGINE_PLANS:  # < 0: the job moved engines
            return (f"the engine built {plans} plan{'' if plans == 1 else 's'} in {now - watch.since:.0f} s "
                    "(a machine too slow for the batch: the job's pieces wait for its iterations)")
        return "its next piece found no free KV block or adapter slot"
