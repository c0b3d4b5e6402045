"""A dead Ray Train run's placement group: removed once the run's workers are gone, not before.

A run whose driver died (the scheduler restarted, or the `DedicatedRun` actor was lost) leaves its
placement group behind on a cluster without Ray's state API (Ray Train's own cleaner needs it), holding
its CPUs or GPUs for good. Removing it at once is a race: Ray Train's controller, owned by the dead run's
actor, dies with it only a moment later, and a controller that sees its workers die first (their
placement group removed) starts a new worker group in a new placement group, which nobody removes and
which then holds the resources the job's next run waits for, forever. So a leftover group is removed
once no worker holds any of its bundles any more (the controller died, and its workers with it), or after
`LEFTOVER_GRACE_S` whatever holds it (a controller that hangs must not keep the job waiting for ever).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

LEFTOVER_GRACE_S = 60.0


class LeftoverGroups:
    """The placement groups dead runs left behind, removed by `sweep` once idle (module docstring).

    Args:
        clock: seconds, monotonic (tests pass their own).
        grace_s: how long a group still in use is left alone.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, grace_s: float = LEFTOVER_GRACE_S) -> None:
        self._clock, self._grace_s = clock, grace_s
        self._pending: dict[str, float] = {}  # group (hex id) -> when it was left behind
        self._lock = threading.Lock()  # `add` on the event loop, `sweep` on the job loop's worker thread

    def add(self, hex_id: str | None) -> None:
        """A dead run's group (None or "": the run never reported one)."""
        if hex_id:
            with self._lock:
                self._pending.setdefault(hex_id, self._clock())

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def sweep(self) -> None:
        """Remove every pending group that is idle, or past its grace; the others wait for the next sweep."""
        with self._lock:
            pending = dict(self._pending)
        for hex_id, since in pending.items():
            idle = group_idle(hex_id)
            if not idle and self._clock() - since < self._grace_s:
                continue
            if not idle:
                logger.warning("a dead dedicated run's placement group %s is still in use after %.0f s; "
                               "removing it", hex_id, self._grace_s)
            remove_group(hex_id)
            with self._lock:
                self._pending.pop(hex_id, None)


def group_idle(hex_id: str) -> bool:
    """Whether no task or actor holds any of the group's bundles (each bundle's resources are all free);
    True for a group Ray no longer has."""
    import ray

    resources = ray.cluster_resources()
    total = {k: v for k, v in resources.items() if k.endswith(f"_group_{hex_id}")}
    free = ray.available_resources()
    return all(free.get(k, 0.0) >= v for k, v in total.items())


def remove_group(hex_id: str) -> None:
    """Remove the group if Ray still has it."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    group = PlacementGroup(ray.PlacementGroupID.from_hex(hex_id))
    if placement_group_table(group).get("state") not in (None, "REMOVED"):
        remove_placement_group(group)
        logger.info("removed the placement group %s a dedicated run left behind", hex_id)
