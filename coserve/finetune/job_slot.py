"""A co-served job's adapter slot: its trainable adapter pinned into a bank slot of its engine when it starts
and released when it ends (the engine unloads the weights with the job); a run that parks between its calls
(`run_parking`: its source `parks`) gives the slot back while idle and takes one again for its next call,
the engine keeping its state in host memory meanwhile. Pure Python."""

from __future__ import annotations

from coserve.contract.plan import IterationPlan
from coserve.contract.sampling import AdapterRef
from coserve.contract.training_plan import JobUnpark
from coserve.finetune.run_parking import RunParking
from coserve.inference.adapter_slots import AdapterSlots


class JobSlot:
    """One job's slot (module docstring).

    Args:
        job_id / adapter_id: the job and its trainable adapter.
        adapters: its engine's adapter slots.
        parks: whether it gives its slot back while idle.
    """

    def __init__(self, job_id: str, adapter_id: int, adapters: AdapterSlots, parks: bool) -> None:
        self._job_id, self._adapter_id, self._adapters = job_id, adapter_id, adapters
        self.slot: int | None = None
        self.parking = RunParking(adapters) if parks else None
        self.wait: str | None = None  # why its last attempt to take a slot failed (None: it did not)

    def take(self, plan: IterationPlan) -> bool:
        """Pin a slot, when it holds none: False while none is free (or it parked in this very plan: it
        comes back in the next). A parked run's state is put back into the slot (`JobUnpark`); a first
        start's `JobStart` installs the weights, so no `AdapterLoad` is sent."""
        if self.slot is not None:
            return True
        if self._job_id in plan.training.job_parks:
            return False
        name, parking = f"training:{self._job_id}", self.parking
        grant = self._adapters.acquire(AdapterRef(self._adapter_id, name, name),
                                       keep_free=0 if parking is None else parking.keep_free)
        if grant is None:
            if parking is not None:
                parking.missed()
            self.wait = (f"all {self._adapters.num_slots} adapter slots of its engine are pinned by requests "
                         "and other jobs; it starts when one is free")
            return False
        self.wait = None
        if grant.evicted_slot is not None:
            plan.adapter_unloads.append(grant.evicted_slot)
        self.slot = grant.slot
        if parking is not None and parking.took_slot():
            plan.training.job_unparks.append(JobUnpark(self._job_id, grant.slot))
        return True

    def release(self) -> None:
        """The job ended: its trainable weights die with it (the engine unloads them), so its slot is free."""
        if self.slot is not None:
            self._adapters.release(self._adapter_id)
            if self._adapters.pin_count(self._adapter_id) == 0:
                self._adapters.forget(self._adapter_id)
            self.slot = None

    def park(self, plan: IterationPlan, idle: bool) -> None:
        """A parking run holding its slot gives it back in `plan` when it should (`RunParking.should_park`;
        `idle`: no call to do and nothing in flight)."""
        parking = self.parking
        if parking is None or self.slot is None or not parking.should_park(idle):
            return
        self._adapters.release(self._adapter_id)
        self._adapters.forget(self._adapter_id)
        self.slot, parking.parked = None, True
        plan.training.job_parks.append(self._job_id)
