"""The engine actors on Ray: N `EngineActor`s, one GPU each (one CPU each on the CPU), pinned by a Ray
placement group with one bundle per engine.

The placement group reserves every engine's GPU before any engine loads its weights, so the engines of
one server either all get a GPU or the server says at start that the cluster cannot hold them
(`EnginesUnavailable`), instead of some engines waiting forever. PACK puts the bundles on as few nodes
as fit (one node with 8 GPUs holds 8 engines; a KubeRay cluster spreads them over its GPU workers when
one node is not enough). An engine actor is created with `max_restarts`: Ray restarts a crashed one in
its own bundle, on its GPU. The group is owned by the actor that creates it (the gateway's Serve replica)
and is removed with it, which ends the engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coserve.server.engine_count import EnginesUnavailable

RAY_NAMESPACE = "coserve"
ENGINE_MAX_RESTARTS = 10  # crashes an engine actor comes back from (then /health says it is gone)
# How long the engines' resources may take to be free (an autoscaling cluster may be adding GPU nodes).
PLACEMENT_TIMEOUT_S = 300.0


def engine_ids(count: int) -> list[str]:
    """The scheduler's names for `count` engines: engine-0, engine-1, ..."""
    return [f"engine-{i}" for i in range(count)]


def actor_name(engine_id: str) -> str:
    """The Ray actor name of an engine (`coserve-engine-0`, ...), in `RAY_NAMESPACE`."""
    return f"coserve-{engine_id}"


def engine_bundle(device: str) -> dict[str, float]:
    """What one engine holds: a GPU with `--device cuda`, else a CPU."""
    return {"GPU": 1.0} if device.startswith("cuda") else {"CPU": 1.0}


@dataclass(frozen=True, slots=True)
class EnginePool:
    """The engine actors of one server and the placement group that pins them.

    Args:
        handles: engine id -> Ray actor handle, in engine order.
        group: the Ray placement group (one bundle per engine, bundle i for engine i).
    """

    handles: dict[str, Any]
    group: Any

    @classmethod
    def create(cls, config: Any, count: int, timeout_s: float = PLACEMENT_TIMEOUT_S) -> EnginePool:
        """Reserve `count` bundles, then start one `EngineActor` in each (they load their weights in
        parallel; `layouts` waits for them).

        Args:
            config: the engines' `EngineConfig` (its `device` picks GPU or CPU bundles).
            count: engines to start.
            timeout_s: how long the bundles may take to be reserved.

        Raises:
            EnginesUnavailable: the cluster did not free the bundles within `timeout_s` (the group is
                removed; the message names what was asked and what the cluster has free).
        """
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from coserve.actors.engine_actor import EngineActor

        bundle = engine_bundle(config.device)
        group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(group)
            free = ray.available_resources()
            raise EnginesUnavailable(f"--engines {count}: the Ray cluster did not free {count} x {bundle} for the "
                                     f"engines within {timeout_s:g} s (free now: {free})")
        handles = {}
        for index, engine_id in enumerate(engine_ids(count)):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
            handles[engine_id] = ray.remote(EngineActor).options(
                name=actor_name(engine_id), namespace=RAY_NAMESPACE, num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0), max_restarts=ENGINE_MAX_RESTARTS, max_task_retries=0,
                scheduling_strategy=strategy).remote(config, engine_id)
        return cls(handles, group)

    def layouts(self) -> dict[str, Any]:
        """Every engine's layout, once it has loaded (an engine that failed to build raises its error)."""
        import ray

        refs = {engine_id: handle.layout.remote() for engine_id, handle in self.handles.items()}
        return {engine_id: ray.get(ref) for engine_id, ref in refs.items()}
