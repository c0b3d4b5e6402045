"""Which LoRA adapter lives in which slot of the engine's adapter bank (LRU, with pinning).

The engine has a fixed number of bank slots. A running request pins its adapter so the slot cannot
be reused under it; an unpinned resident adapter stays loaded (a later request reuses it without a
reload) until its slot is needed, least recently used first.

Every time a slot was asked for and none could be given, `misses` counts one: the sign that someone
waits for a slot, which idle holders read to give theirs back (a Tinker run between its calls:
`finetune.run_parking`). An acquire may ask to leave `keep_free` slots available to others (empty, or
holding an adapter no one pins): a Tinker run leaves one for inference requests.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from coserve.contract.plan import AdapterLoad, IterationPlan
from coserve.contract.sampling import AdapterRef


@dataclass(slots=True)
class SlotGrant:
    """The answer to `AdapterSlots.acquire`: where the adapter is and what the engine must do.

    Attributes:
        slot: the bank slot the adapter occupies (pass it as `NewSequence.adapter_slot`).
        load: set when the engine must load the adapter into `slot` before the forward.
        evicted_slot: set when another adapter was evicted from a slot to make room (the engine
            unloads it before loading; it equals `slot`).
    """

    slot: int
    load: AdapterLoad | None = None
    evicted_slot: int | None = None


class AdapterSlots:
    """LRU assignment of adapters to `num_slots` bank slots; pinned adapters are never evicted.

    Args:
        num_slots: slots in the engine's LoRA bank.

    Raises:
        ValueError: ``num_slots`` < 1.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._num_slots = num_slots
        self._empty_slots: list[int] = list(range(num_slots))
        self._resident: dict[int, tuple[int, AdapterRef]] = {}  # adapter id -> (slot, ref)
        self._pins: dict[int, int] = {}  # adapter id -> pin count (absent: unpinned)
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident adapter ids, least recent first
        self.misses = 0  # slots asked for and not given (module docstring)

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def slot_of(self, adapter_id: int) -> int | None:
        """The slot holding the adapter, or None if it is not resident."""
        entry = self._resident.get(adapter_id)
        return entry[0] if entry is not None else None

    def pin_count(self, adapter_id: int) -> int:
        return self._pins.get(adapter_id, 0)

    def can_acquire(self, adapter: AdapterRef) -> bool:
        """Whether `acquire` would succeed now (changes nothing but `misses`, counted when it would not)."""
        if adapter.adapter_id in self._resident or self._empty_slots or self._lru_unpinned() is not None:
            return True
        self.misses += 1
        return False

    @property
    def available(self) -> int:
        """Slots an adapter could take now: empty, or holding one no one pins."""
        return len(self._empty_slots) + sum(1 for a in self._resident if a not in self._pins)

    def acquire(self, adapter: AdapterRef, keep_free: int = 0) -> SlotGrant | None:
        """Pin the adapter into a slot, loading it (and evicting the LRU unpinned one) if needed; a new
        slot only when `keep_free` others stay available after it.

        Returns:
            The grant, or None when every slot holds a pinned adapter, or too few are available (the
            caller waits; `misses` counts one).

        Raises:
            ValueError: the adapter id is resident with a different path.
        """
        adapter_id = adapter.adapter_id
        if adapter_id not in self._resident and self.available - 1 < keep_free:
            self.misses += 1
            return None
        entry = self._resident.get(adapter_id)
        if entry is not None:
            slot, resident = entry
            if resident.path != adapter.path:
                raise ValueError(f"adapter id {adapter_id} is loaded from {resident.path!r}, "
                                 f"not {adapter.path!r}")
            self._pin(adapter_id)
            return SlotGrant(slot=slot)
        evicted_slot: int | None = None
        if self._empty_slots:
            slot = self._empty_slots.pop(0)
        else:
            victim = self._lru_unpinned()
            if victim is None:
                self.misses += 1
                return None
            slot = self._resident.pop(victim)[0]
            del self._lru[victim]
            evicted_slot = slot
        self._resident[adapter_id] = (slot, adapter)
        self._pin(adapter_id)
        load = AdapterLoad(slot=slot, adapter_id=adapter_id, path=adapter.path)
        return SlotGrant(slot=slot, load=load, evicted_slot=evicted_slot)

    def release(self, adapter_id: int) -> None:
        """Unpin the adapter once; it stays resident until its slot is needed.

        Raises:
            ValueError: the adapter is not pinned.
        """
        pins = self._pins.get(adapter_id, 0)
        if pins == 0:
            raise ValueError(f"release of adapter id {adapter_id}, which is not pinned")
        if pins == 1:
            del self._pins[adapter_id]
        else:
            self._pins[adapter_id] = pins - 1

    def _pin(self, adapter_id: int) -> None:
        self._pins[adapter_id] = self._pins.get(adapter_id, 0) + 1
        # Use order, not release order, decides eviction: the adapter just asked for is the newest.
        self._lru[adapter_id] = None
        self._lru.move_to_end(adapter_id)

    def _lru_unpinned(self) -> int | None:
        return next((a for a in self._lru if a not in self._pins), None)

    def forget(self, adapter_id: int) -> int | None:
        """Make an unpinned adapter's slot empty (its adapter is gone: a deleted model, an ended
        training job); returns the slot, which the caller unloads, or None if it was not resident.

        Raises:
            ValueError: the adapter is pinned (requests or a job still use it).
        """
        if self._pins.get(adapter_id, 0):
            raise ValueError(f"adapter id {adapter_id} is pinned; release it first")
        entry = self._resident.pop(adapter_id, None)
        if entry is None:
            return None
        del self._lru[adapter_id]
        self._empty_slots.append(entry[0])
        return entry[0]


class RunningAdapters:
    """The adapter slot of every running request (-1: the base model), and how many distinct slots the
    running batch uses: what the latency model's `distinct_adapters` feature counts, kept as requests
    are admitted and released instead of recounted every plan."""

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}  # running request -> adapter slot
        self._users: Counter[int] = Counter()  # adapter slot -> running requests using it

    def admitted(self, request_id: str, slot: int) -> None:
        self.slots[request_id] = slot
        self._users[slot] += 1

    def released(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._users[slot] -= 1
            if not self._users[slot]:
                del self._users[slot]

    @property
    def distinct_adapters(self) -> int:
        """Distinct adapters (base model rows not counted) of the running requests."""
        users = self._users
        return len(users) - (-1 in users)


def acquire_into(adapters: AdapterSlots, adapter: AdapterRef, plan: IterationPlan) -> int:
    """Pin `adapter` (after `can_acquire` said yes) and add the unload and load it needs to `plan`.

    Returns:
        Its slot.

    Raises:
        RuntimeError: no slot is free after all (a bug: `can_acquire` was not asked first).
    """
    grant = adapters.acquire(adapter)
    if grant is None:
        raise RuntimeError(f"adapter slot vanished between can_acquire and acquire for {adapter.name!r}")
    if grant.evicted_slot is not None:
        plan.adapter_unloads.append(grant.evicted_slot)
    if grant.load is not None:
        plan.adapter_loads.append(grant.load)
    return grant.slot
