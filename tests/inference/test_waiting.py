"""Waiting queues: FIFO, and per-tenant sub-queues in VTC order with backlog callbacks."""

from __future__ import annotations

import pytest

from coserve.contract.sampling import SamplingParams
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.request import Request
from coserve.inference.waiting import FifoQueue, TenantQueues
from coserve.tenancy.vtc import VirtualTokenCounter, VTCWeights


def req(rid: str, tenant: str, arrival: float = 0.0) -> Request:
    return Request(rid, [1, 2], SamplingParams(), tenant=tenant, arrival_time=arrival)


def make_queues() -> tuple[TenantQueues, VirtualTokenCounter, list[str]]:
    vtc = VirtualTokenCounter(VTCWeights(), {"a": 1.0, "b": 1.0})
    changes: list[str] = []

    def on_change(tenant: str) -> None:
        changes.append(tenant)
        (vtc.on_backlogged if queues.has_tenant(tenant) else vtc.on_idle)(tenant)

    queues = TenantQueues(vtc, on_change)
    return queues, vtc, changes


def test_head_is_the_earliest_request_of_the_least_counter_tenant() -> None:
    queues, vtc, changes = make_queues()
    for r in (req("a1", "a", 1.0), req("a2", "a", 2.0), req("b1", "b", 3.0)):
        queues.append(r)
    assert changes == ["a", "b"]  # only empty -> non-empty transitions
    assert queues.head().request_id == "a1"  # tie: smallest name
    vtc.charge_input("a", 5)
    assert queues.head().request_id == "b1"
    assert [r.request_id for r in queues.arrived_by(2.0)] == ["a1", "a2"]
    preempted = req("b0", "b", 0.5)
    queues.appendleft(preempted)
    assert queues.head() is preempted
    assert [r.request_id for r in queues.arrived_by(1.0)] == ["b0", "a1"]
    assert len(queues) == 4 and [r.request_id for r in queues] == ["a1", "a2", "b0", "b1"]


def test_remove_reports_the_tenant_going_idle() -> None:
    queues, vtc, changes = make_queues()
    r = req("b1", "b")
    queues.append(r)
    assert r in queues and "b" in vtc.backlogged
    queues.remove(r)
    assert changes == ["b", "b"] and "b" not in vtc.backlogged and queues.head() is None
    with pytest.raises(ValueError, match="not queued"):
        queues.remove(r)
    assert r not in queues and "not a request" not in queues


def test_fifo_head() -> None:
    fifo = FifoQueue()
    assert fifo.head() is None
    fifo.append(req("x", "a"))
    fifo.appendleft(req("y", "a"))
    assert fifo.head().request_id == "y"


def test_allocate_table_returns_an_immutable_snapshot_or_none() -> None:
    kv = KVBlockManager(num_blocks=4, block_size=4)
    table = kv.allocate_table("r", 5)
    assert isinstance(table, tuple)  # the plan cannot corrupt the manager, nor the manager the plan
    assert list(table) == kv.block_table("r") and len(table) == 2
    assert kv.allocate_table("r", 8) is table  # inside the blocks it has: the same snapshot
    grown = kv.allocate_table("r", 9)
    assert len(grown) == 3 and grown[:2] == table and list(grown) == kv.block_table("r")
    assert table == (0, 1)  # the earlier plan's table did not change
    assert kv.allocate_table("s", 9) is None and not kv.has_table("s")
    kv.free("r")
    again = kv.allocate_table("r", 4)
    assert list(again) == kv.block_table("r") and len(again) == 1  # no stale snapshot after free
    with pytest.raises(ValueError, match="num_total_tokens"):
        kv.allocate_table("r", -1)
