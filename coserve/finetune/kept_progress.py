"""A job's progress as the watchdog counts it: work that stays done, not work planned.

A sequence's forward windows and backward tasklets are undone when inference takes its KV blocks back
(`CoservedJob.release_kv`: the sequence restarts from its first token), so a job whose sequence keeps
being dropped and restarted plans work in every iteration and gets nowhere. `KeptProgress` counts, for
each sequence of the batch in flight, the furthest it has got (in token-layers: a forward token passes
every layer, a backward tasklet of t tokens over one layer is t), and moves only when a sequence goes past
its own furthest point: redoing the same windows after a restart is not progress. A sequence that is
done (its backward planned, or a forward-only one's last window) can no longer be dropped, so what it
reached stays; optimizer steps of a driven run, its saves and loads, and a reinforcement job's sampled
rollouts add to the count. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable

from coserve.finetune.progress import BatchProgress, SequenceProgress


class KeptProgress:
    """A monotone count of the work a job has done that no KV reclaim undoes (module docstring)."""

    def __init__(self) -> None:
        self.total = 0
        self._batch: BatchProgress | None = None  # the batch whose sequences `_furthest` follows
        self._furthest: dict[str, int] = {}  # sequence id -> the most token-layers it has reached

    def reached(self, batch: BatchProgress, sequences: Iterable[SequenceProgress]) -> None:
        """Note where these sequences of `batch` are now (after work was planned for them)."""
        if batch is not self._batch:
            self._batch, self._furthest = batch, {}
        for seq in sequences:
            done = seq.token_layers_done
            gain = done - self._furthest.get(seq.sequence_id, 0)
            if gain > 0:
                self.total += gain
                self._furthest[seq.sequence_id] = done

    def add(self, amount: int = 1) -> None:
        """Progress outside sequences: a driven run's step, save or load; rollouts sampled and graded."""
        self.total += amount
