"""AdapterSlots: LRU residency of LoRA adapters in the engine's bank, with pinning."""

from __future__ import annotations

import pytest

from coserve.contract.plan import AdapterLoad
from coserve.contract.sampling import AdapterRef
from coserve.inference.adapter_slots import AdapterSlots, SlotGrant


def _ref(adapter_id: int) -> AdapterRef:
    return AdapterRef(adapter_id=adapter_id, name=f"a{adapter_id}", path=f"/adapters/{adapter_id}")


def test_first_acquire_loads_into_an_empty_slot() -> None:
    slots = AdapterSlots(2)
    grant = slots.acquire(_ref(7))
    assert grant == SlotGrant(slot=0, load=AdapterLoad(slot=0, adapter_id=7, path="/adapters/7"))
    assert slots.slot_of(7) == 0
    assert slots.pin_count(7) == 1
    assert slots.acquire(_ref(8)) == SlotGrant(slot=1, load=AdapterLoad(1, 8, "/adapters/8"))


def test_resident_adapter_is_reused_without_reload() -> None:
    slots = AdapterSlots(1)
    slots.acquire(_ref(7))
    slots.release(7)
    assert slots.slot_of(7) == 0  # unpinned but still loaded
    assert slots.acquire(_ref(7)) == SlotGrant(slot=0)
    assert slots.acquire(_ref(7)) == SlotGrant(slot=0)
    assert slots.pin_count(7) == 2


def test_evicts_least_recently_used_unpinned() -> None:
    slots = AdapterSlots(3)
    for adapter_id in (1, 2, 3):
        slots.acquire(_ref(adapter_id))
    slots.acquire(_ref(1))  # 1 is now the most recently used
    for adapter_id in (1, 1, 2, 3):
        slots.release(adapter_id)
    grant = slots.acquire(_ref(4))
    assert grant is not None and grant.slot == 1 and grant.evicted_slot == 1  # 2 was LRU
    assert grant.load == AdapterLoad(slot=1, adapter_id=4, path="/adapters/4")
    assert slots.slot_of(2) is None
    grant = slots.acquire(_ref(5))
    assert grant is not None and grant.evicted_slot == 2  # then 3
    assert slots.slot_of(1) == 0


def test_pinned_adapters_are_never_evicted() -> None:
    slots = AdapterSlots(2)
    slots.acquire(_ref(1))
    slots.acquire(_ref(2))
    assert not slots.can_acquire(_ref(3))
    assert slots.acquire(_ref(3)) is None
    assert slots.slot_of(1) == 0 and slots.slot_of(2) == 1
    assert slots.can_acquire(_ref(1))  # resident: no slot needed
    slots.release(2)
    assert slots.can_acquire(_ref(3))
    grant = slots.acquire(_ref(3))
    assert grant is not None and grant.slot == 1 and grant.evicted_slot == 1


def test_pins_count_per_acquire() -> None:
    slots = AdapterSlots(1)
    slots.acquire(_ref(1))
    slots.acquire(_ref(1))
    slots.release(1)
    assert slots.acquire(_ref(2)) is None  # one pin left
    slots.release(1)
    assert slots.acquire(_ref(2)) is not None
    with pytest.raises(ValueError, match="adapter id 1"):
        slots.release(1)


def test_invalid_use_raises() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        AdapterSlots(0)
    slots = AdapterSlots(1)
    slots.acquire(_ref(1))
    with pytest.raises(ValueError, match="/elsewhere"):
        slots.acquire(AdapterRef(adapter_id=1, name="a1", path="/elsewhere"))
