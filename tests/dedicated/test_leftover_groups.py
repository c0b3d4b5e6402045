"""A dead run's placement group is removed once nothing holds its bundles (or after the grace), on real Ray:
removing it while an orphaned Ray Train controller still lives made that controller start a new worker
group that held the cluster's CPUs for good (seen in the full suite: the resumed job waited for ever)."""

from __future__ import annotations

import time

import pytest

from coserve.jobs.leftover_groups import LeftoverGroups, group_idle

pytestmark = pytest.mark.ray


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _group_with_a_worker() -> tuple[object, object]:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(group.ready(), timeout=60)

    @ray.remote(num_cpus=1)
    class Worker:
        def ping(self) -> int:
            return 1

    worker = Worker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 1)).remote()
    ray.get(worker.ping.remote(), timeout=60)
    return group, worker


def _state(group: object) -> str:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(group)["state"]


def test_a_group_is_removed_once_its_workers_are_gone_not_before(ray_cluster: None) -> None:
    import ray

    group, worker = _group_with_a_worker()
    clock = _Clock()
    leftovers = LeftoverGroups(clock=clock, grace_s=60.0)
    leftovers.add(None)
    leftovers.add("")
    leftovers.add(group.id.hex())
    assert len(leftovers) == 1 and not group_idle(group.id.hex())
    clock.now = 59.0
    leftovers.sweep()
    assert _state(group) == "CREATED" and len(leftovers) == 1  # a worker still holds a bundle
    ray.kill(worker)
    deadline = time.monotonic() + 30
    while len(leftovers) and time.monotonic() < deadline:
        time.sleep(0.2)
        leftovers.sweep()
    assert _state(group) == "REMOVED" and len(leftovers) == 0
    assert group_idle(group.id.hex())  # a group Ray no longer has holds nothing


def test_a_group_still_held_after_the_grace_is_removed_anyway(ray_cluster: None) -> None:
    group, _worker = _group_with_a_worker()
    clock = _Clock()
    leftovers = LeftoverGroups(clock=clock, grace_s=60.0)
    leftovers.add(group.id.hex())
    clock.now = 61.0
    leftovers.sweep()
    assert _state(group) == "REMOVED" and len(leftovers) == 0
