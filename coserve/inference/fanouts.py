"""Fan-outs (one prompt, `n` sequences) under the TTFT guard: one sequence each, not all of them.

A request with `n` > 1 becomes `n` sequences that share the parent's arrival time (`Request.parent_id`
names the parent). Once they had waited past the TTFT guard, all of them used to be overdue at once,
and the guard admits overdue requests before the counters' choice, oldest first: a tenant's fan-out
of 128 took every free slot until it was drained, whatever its virtual token counter said, and a light
tenant's newer request waited behind all of it (measured, policy level, 8 slots, fan-outs of 16 x 32
tokens: up to 12.7 s, against 0.7 s with the guard off; the counters were charged per sequence all
along).

The guard is there for the client's time to first token, which the fan-out's first admitted sequence
meets. So only one sequence of a fan-out can be overdue, and none once one of them was admitted; the
others wait in VTC order like separate requests, each charged when admitted, so other tenants' requests
are admitted between them.
"""

from __future__ import annotations

from collections import Counter

from coserve.inference.request import Request


class FanOuts:
    """The unfinished sequences of each fan-out, and the fan-outs whose first token is on its way."""

    def __init__(self) -> None:
        self._live: Counter[str] = Counter()  # parent id -> unfinished sequences
        self._started: set[str] = set()  # parents with a sequence admitted

    def added(self, request: Request) -> None:
        """A sequence was queued."""
        if request.parent_id is not None:
            self._live[request.parent_id] += 1

    def admitted(self, request: Request) -> None:
        """A sequence was admitted: its fan-out's TTFT no longer needs the guard."""
        if request.parent_id is not None:
            self._started.add(request.parent_id)

    def finished(self, request: Request) -> None:
        """A sequence finished (or was aborted); a fan-out without sequences left is forgotten."""
        parent = request.parent_id
        if parent is None or parent not in self._live:
            return
        self._live[parent] -= 1
        if self._live[parent] <= 0:
            del self._live[parent]
            self._started.discard(parent)

    def guarded(self, overdue: list[Request]) -> list[Request]:
        """The overdue requests (oldest first) the TTFT guard acts for: requests of their own, and of
        each fan-out not yet started its first queued sequence only."""
        kept: list[Request] = []
        seen: set[str] = set()
        for request in overdue:
            parent = request.parent_id
            if parent is not None:
                if parent in self._started or parent in seen:
                    continue
                seen.add(parent)
            kept.append(request)
        return kept

    def __len__(self) -> int:
        return len(self._live)
