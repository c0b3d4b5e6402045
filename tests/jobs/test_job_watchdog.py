"""The watchdog's events on a job whose sequence KV reclaim keeps restarting (`JobWatchdog.check_restarts`).
That such a job's progress marker stays put while it redoes its windows: tests/planner/test_kv_reclaim.py."""

from __future__ import annotations

from coserve.contract.job_runner import SequenceRestarts
from coserve.finetune.sequence_kv import MAX_DROPS
from coserve.jobs.watchdog import JobWatchdog


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_restarted_sequence_gets_an_event_at_most_once_a_stall_period() -> None:
    clock = _Clock()
    dog = JobWatchdog(stall_after_s=60.0, clock=clock)
    assert dog.check_restarts({"a": SequenceRestarts(), "b": SequenceRestarts()}) == []
    clock.now = 5.0
    [notice] = dog.check_restarts({"a": SequenceRestarts(1, 512), "b": SequenceRestarts()})
    assert notice.job_id == "a" and not notice.stalled
    assert notice.message == (f"A training sequence of 512 tokens was dropped {MAX_DROPS} times in a row to free "
                              "KV blocks for inference requests, restarting from its first token each time; it now "
                              "keeps its blocks until it is done")
    clock.now = 30.0
    assert dog.check_restarts({"a": SequenceRestarts(2, 512)}) == []  # within a minute of the last one
    clock.now = 66.0
    [again] = dog.check_restarts({"a": SequenceRestarts(3, 256)})
    assert again.message.endswith("until it is done (3 sequences so far)") and "of 256 tokens" in again.message
    clock.now = 200.0
    assert dog.check_restarts({"a": SequenceRestarts(3, 256)}) == []  # nothing new
    # The job starts again on another engine (its count starts over): new restarts are said.
    [moved] = dog.check_restarts({"a": SequenceRestarts(1, 64)})
    assert "of 64 tokens" in moved.message

