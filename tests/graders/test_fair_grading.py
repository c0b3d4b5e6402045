"""Grading shared between tenants: python grader slots (`FairSlots`) and grading threads (`FairPool`) go to
the tenant with the least grading time, each tenant under its cap, never first come first served."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from coserve.contract.grader import parse_grader
from coserve.graders.fair_pool import FairPool
from coserve.graders.fair_queue import FairQueue
from coserve.graders.fair_slots import FairSlots, GradersBusy
from coserve.graders.rollout_grading import RolloutGrader


def test_the_queue_serves_the_least_served_tenant_under_its_cap() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=1)
    for i in range(3):
        queue.push("attacker", f"a{i}")
    assert queue.pop() == ("attacker", "a0")
    assert queue.pop() is None  # the attacker is at its cap, nobody else waits
    queue.push("victim", "v0")
    queue.push("victim", "v1")
    assert queue.pop() == ("victim", "v0")
    queue.done("attacker", 5.0)
    queue.done("victim", 0.1)
    assert queue.pop() == ("victim", "v1")  # less grading time than the attacker, though it came last
    assert queue.counter("attacker") == pytest.approx(5.0)


def test_an_idle_tenant_does_not_bank_credit() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=4)
    queue.push("a", "a0")
    assert queue.pop() == ("a", "a0")
    queue.done("a", 100.0)  # a alone used 100 s
    queue.push("a", "a1")
    queue.pop()
    queue.push("b", "b0")  # b arrives: lifted to a's counter, not served for 100 s straight
    assert queue.counter("b") == pytest.approx(100.0)


def test_slots_a_tenant_holds_at_most_its_share_and_a_freed_slot_goes_to_the_least_served() -> None:
    slots = FairSlots(2)  # one per tenant at once
    first = slots.acquire("attacker")
    with pytest.raises(GradersBusy):
        slots.acquire("attacker", timeout=0.05)
    victim = slots.acquire("victim", timeout=0.05)
    got: list[str] = []
    waiters = [threading.Thread(target=lambda t=t: got.append(slots.acquire(t).tenant)) for t in ("attacker", "late")]
    for waiter in waiters:
        waiter.start()
        time.sleep(0.05)
    slots.release(victim)  # the attacker waited first but holds a slot: "late" gets this one
    time.sleep(0.1)
    assert got == ["late"]
    slots.release(first)
    waiters[0].join(timeout=2)
    assert got == ["late", "attacker"]


def test_an_async_wait_times_out_holding_nothing_and_a_cancelled_one_gives_back_its_slot() -> None:
    async def scenario() -> None:
        slots = FairSlots(1, per_tenant=1)
        held = await slots.acquire_async("a", 0.1)
        with pytest.raises(GradersBusy):
            await slots.acquire_async("b", 0.1)
        waiting = asyncio.create_task(slots.acquire_async("b", 5.0))
        await asyncio.sleep(0.05)
        waiting.cancel()
        slots.release(held)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        again = await slots.acquire_async("c", 0.5)  # nothing leaked to the cancelled caller
        assert again.slot == 0 and slots.held("b") == 0

    asyncio.run(scenario())


def test_a_tenant_waits_in_a_bounded_line() -> None:
    slots = FairSlots(1, max_waiting=2)
    slots.acquire("a")
    for _ in range(2):
        threading.Thread(target=lambda: pytest.raises(GradersBusy, slots.acquire, "b", 0.5), daemon=True).start()
    time.sleep(0.1)
    with pytest.raises(GradersBusy, match="already waiting"):
        slots.acquire("b", timeout=5.0)


def test_the_pool_starts_a_new_tenants_task_before_a_big_batch_ahead_of_it() -> None:
    pool = FairPool(2, name="test-grading")  # one thread per tenant at most while both wait
    order: list[str] = []
    gate = threading.Event()

    def work(name: str) -> str:
        gate.wait(5)
        order.append(name)
        return name

    batch = [pool.submit("attacker", work, f"a{i}") for i in range(6)]
    victim = pool.submit("victim", work, "v0")
    gate.set()
    assert victim.result(timeout=5) == "v0" and all(f.result(timeout=5) for f in batch)
    assert order.index("v0") <= 1, order  # FIFO would have run it seventh
    pool.shutdown()


def test_the_pool_bounds_a_tenants_queue_and_reports_failures_on_the_future() -> None:
    pool = FairPool(1, max_queued=1, name="test-grading")
    gate = threading.Event()
    running = pool.submit("a", gate.wait, 5)
    time.sleep(0.05)
    queued = pool.submit("a", lambda: 1 / 0)
    with pytest.raises(GradersBusy):
        pool.submit("a", int)
    other = pool.submit("b", int, "7")
    gate.set()
    assert running.result(timeout=5) is True and other.result(timeout=5) == 7
    with pytest.raises(ZeroDivisionError):
        queued.result(timeout=5)
    pool.shutdown(cancel_futures=True)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit("a", int)


def test_a_reinforcement_jobs_big_batch_does_not_hold_another_tenants_samples_behind_it() -> None:
    """Rollout grading on the scheduler's fair pool: the attacker's 8 slow samples were submitted first,
    the victim's 2 are graded on the next free thread, not after the batch."""

    def decode(ids: list[int] | tuple[int, ...]) -> str:
        if ids[0] == 1:
            time.sleep(0.25)  # the attacker's sample: slow to grade
        return "x"

    grader = parse_grader({"type": "string_check", "name": "s", "input": "{{ sample.output_text }}",
                           "reference": "x", "operation": "eq"})
    pool = FairPool(2, name="test-rollouts")
    rollouts = RolloutGrader(decode, executor=pool)
    start = time.monotonic()
    batch = rollouts.grade("attacker", grader, [{}] * 8, [[1]] * 8)
    time.sleep(0.05)
    victim = rollouts.grade("victim", grader, [{}] * 2, [[2]] * 2)
    assert [s.reward for s in victim.result(timeout=5)] == [1.0, 1.0]
    victim_s = time.monotonic() - start
    assert [s.reward for s in batch.result(timeout=10)] == [1.0] * 8
    assert victim_s < 0.6 < time.monotonic() - start, victim_s  # FIFO: after the batch's 8 x 0.25 s / 2 threads
    pool.shutdown()
