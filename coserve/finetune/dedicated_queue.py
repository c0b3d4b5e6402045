"""The queue of dedicated runs waiting for workers (pure Python): runs launch first come, first served,
and each waiting run's job is told its place, once when it joins and again whenever the place changes
(a run ahead launched, was paused or cancelled), not at every look at the cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueuePosition:
    """A waiting run's place: `position` 1 launches next, of `length` runs waiting."""

    job_id: str
    position: int
    length: int

    def words(self) -> str:
        """E.g. "queued for a dedicated run: position 2 of 3" (the job's event, capitalized)."""
        return f"queued for a dedicated run: position {self.position} of {self.length}"


class RunQueue:
    """Remembers the place each waiting run was last told."""

    def __init__(self) -> None:
        self._told: dict[str, int] = {}

    def update(self, waiting: Sequence[str]) -> list[QueuePosition]:
        """The places of the runs `waiting` now (job ids, first to launch first) that changed since the
        last update: a run that just joined, or moved. A run no longer waiting is forgotten."""
        places = [QueuePosition(job_id, k, len(waiting)) for k, job_id in enumerate(waiting, 1)]
        changed = [place for place in places if self._told.get(place.job_id) != place.position]
        self._told = {place.job_id: place.position for place in places}
        return changed
