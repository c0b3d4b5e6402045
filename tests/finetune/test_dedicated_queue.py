"""The queue of dedicated runs waiting for workers (`coserve.finetune.dedicated_queue`): each waiting run's
job is told its place when it joins and whenever it moves, never again for a place it was told."""

from __future__ import annotations

from coserve.finetune.dedicated_queue import QueuePosition, RunQueue


def test_places_are_told_on_joining_and_on_moving_only() -> None:
    queue = RunQueue()
    assert queue.update(["a"]) == [QueuePosition("a", 1, 1)]
    assert queue.update(["a"]) == []  # the next look at the cluster: nothing moved, nothing told
    assert queue.update(["a", "b", "c"]) == [QueuePosition("b", 2, 3), QueuePosition("c", 3, 3)]
    assert queue.update(["a", "b", "c"]) == []
    assert queue.update(["b", "c"]) == [QueuePosition("b", 1, 2), QueuePosition("c", 2, 2)]  # "a" launched
    assert queue.update(["c"]) == [QueuePosition("c", 1, 1)]  # "b" cancelled
    assert queue.update([]) == []
    assert queue.update(["b"]) == [QueuePosition("b", 1, 1)]  # back (resumed): told again
    assert QueuePosition("c", 2, 3).words() == "queued for a dedicated run: position 2 of 3"
