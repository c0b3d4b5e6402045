"""Several engines on real Ray: the engine actors pinned by a placement group, one CPU each here (one GPU
each with --device cuda), and `--engines` refused above what the cluster holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coserve.platform.engine import EngineConfig
from coserve.server.engine_count import EnginesUnavailable, engine_room
from coserve.server.engine_pool import RAY_NAMESPACE, EnginePool, actor_name

CLUSTER_CPUS = 3  # two engines (one CPU each) and room for the third test's refusal


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False, namespace=RAY_NAMESPACE,
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_two_cpu_engines_are_created_and_placed_one_bundle_each(ray_cluster: None, llama_dir: Path) -> None:
    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group

    pool = EnginePool.create(EngineConfig(model=str(llama_dir), dtype="float32"), 2)
    try:
        layouts = pool.layouts()
        assert list(layouts) == ["engine-0", "engine-1"]
        assert all(layout.num_kv_blocks > 0 for layout in layouts.values())
        table = placement_group_table(pool.group)
        assert table["state"] == "CREATED" and table["strategy"] == "PACK"
        assert list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
        placements = [ray.get(handle.placement.remote()) for handle in pool.handles.values()]
        for placement in placements:
            assert placement["placement_group"] == pool.group.id.hex()
            assert placement["resources"] == {"CPU": 1.0} and placement["gpu_ids"] == []
        # The engines are the named actors the server finds and an operator kills, in separate processes.
        pids = {ray.get(ray.get_actor(actor_name(e), namespace=RAY_NAMESPACE).pid.remote()) for e in pool.handles}
        assert len(pids) == 2
        assert ray.available_resources().get("CPU", 0) == CLUSTER_CPUS - 2
    finally:
        for handle in pool.handles.values():
            ray.kill(handle)
        remove_placement_group(pool.group)


def test_more_engines_than_the_cluster_holds_are_refused(ray_cluster: None, llama_dir: Path) -> None:
    import ray

    room = engine_room("cpu")  # connected: the cluster's CPUs, not this machine's cores
    assert (room.resource, room.available, room.where) == ("CPU", CLUSTER_CPUS, "the Ray cluster")
    assert room.count(None) == 1 and room.count(CLUSTER_CPUS) == CLUSTER_CPUS
    with pytest.raises(EnginesUnavailable, match=rf"--engines 4: the Ray cluster has {CLUSTER_CPUS} CPU\(s\)"):
        room.count(4)
    with pytest.raises(EnginesUnavailable, match=r"--engines 4: the Ray cluster has 0 GPU\(s\) and each engine takes one GPU"):
        engine_room("cuda").count(4)
    # Bundles the cluster cannot free in time: refused, and nothing is left reserved.
    with pytest.raises(EnginesUnavailable, match=r"did not free 4 x \{'CPU': 1.0\}"):
        EnginePool.create(EngineConfig(model=str(llama_dir), dtype="float32"), 4, timeout_s=1.0)
    assert ray.available_resources().get("CPU", 0) == CLUSTER_CPUS
