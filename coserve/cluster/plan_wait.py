"""The scheduler's half of the server loop: an engine's next plan, waited for while it has no work.

Each engine loop (`actors/engine_actor.py`) hands its last result to the scheduler and asks for its next
plan (`SchedulerActor.exchange`: one round trip per iteration). The plan comes from the engine's
`EngineCore` through the `EngineCluster` (`next_plan`); this is what happens when there is none: with
no work the loop sleeps until something new arrives (`work`: a request, a job, a result that leaves work
for another engine); with work that cannot run yet (no free KV block), it backs off, up to
`EMPTY_PLAN_WAIT_S`, unless something new arrives (a job that stays stuck is the watchdog's to report).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from coserve.cluster.engine_cluster import EngineCluster
from coserve.contract.plan import IterationPlan

# The longest wait before planning again after an empty plan (work that cannot run yet).
EMPTY_PLAN_WAIT_S = 0.05


async def next_plan_when_ready(cluster: EngineCluster, engine_id: str, work: asyncio.Event,
                               serving: Callable[[], bool]) -> IterationPlan | None:
    """The engine's next plan, once it has one; None when `serving()` turns false meanwhile (the
    scheduler shut down, or the engine was lost: its loop's call ends)."""
    idle_s = 0.0
    while serving():
        if cluster.has_work(engine_id):
            plan = cluster.next_plan(engine_id)
            if plan is not None:
                return plan
            idle_s = min(max(2 * idle_s, 0.001), EMPTY_PLAN_WAIT_S)
            work.clear()
            try:
                await asyncio.wait_for(work.wait(), idle_s)
            except TimeoutError:
                pass
        else:
            work.clear()
            await work.wait()
    return None
