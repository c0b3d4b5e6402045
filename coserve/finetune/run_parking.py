"""When a training run driven by its client (a Tinker run) gives its adapter slot back, and takes one again.

A run holds a bank slot of its engine only while it has a call to do. Between calls the scheduler
*parks* it (`TrainingWork.job_parks`): the engine keeps its state (LoRA weights, gradient, AdamW
moments) in host memory and empties the slot. It does so in the next plan once the run is idle and

* anything failed to get a slot since the run last looked (`AdapterSlots.misses`: a request for another
  adapter, a job, another run), or
* the run has been idle for `PARK_IDLE_S` (its memory leaves the device even when no one waits).

The run's next call takes a slot again (`JobUnpark`: the engine puts the state back, exactly, into that
slot), leaving `RUN_KEEP_FREE` slot available to inference requests (a run never takes the bank's last
free slot when it has more than one), or waits, its calls' pending answer saying why (`wait_reason`).
A tenant with more runs than slots thus holds slots only for the calls it is doing. Pure Python.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from coserve.inference.adapter_slots import AdapterSlots

PARK_IDLE_S = 30.0
RUN_KEEP_FREE = 1


class RunParking:
    """One run's slot bookkeeping (module docstring).

    Args:
        adapters: its engine's adapter slots.
        clock: seconds (monotonic).
        park_idle_s: idle this long, it parks even when no one waits for a slot.
    """

    def __init__(self, adapters: AdapterSlots, clock: Callable[[], float] = time.monotonic,
                 park_idle_s: float = PARK_IDLE_S) -> None:
        self._adapters, self._clock, self._park_idle_s = adapters, clock, park_idle_s
        self._seen_misses = adapters.misses
        self._busy_at = clock()
        self.parked = False  # its state is in host memory, its slot given back
        self.wait_reason: str | None = None  # why its last attempt to take a slot failed (None: it did not)

    @property
    def keep_free(self) -> int:
        """Slots its acquire leaves available to others."""
        return RUN_KEEP_FREE if self._adapters.num_slots > RUN_KEEP_FREE else 0

    def should_park(self, idle: bool) -> bool:
        """Whether a run holding its slot parks in this plan (`idle`: no call to do, nothing in flight)."""
        misses = self._adapters.misses
        contended, self._seen_misses = misses != self._seen_misses, misses
        now = self._clock()
        if not idle:
            self._busy_at = now
            return False
        return contended or now - self._busy_at >= self._park_idle_s

    def missed(self) -> None:
        """Its attempt to take a slot failed: say why."""
        slots = self._adapters.num_slots
        kept = f"; a run leaves {self.keep_free} of them to inference requests" if self.keep_free else ""
        self.wait_reason = (f"all {slots} adapter slots of its engine are in use by requests, fine-tuning jobs "
                            f"and runs with calls to do{kept}; it runs as soon as one is free")

    def took_slot(self) -> bool:
        """It has a slot now; returns whether it was parked (its state is to be put back)."""
        was, self.parked, self.wait_reason = self.parked, False, None
        self._busy_at, self._seen_misses = self._clock(), self._adapters.misses
        return was
