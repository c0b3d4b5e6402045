"""Late binding: an engine about to plan with free batch slots takes waiting requests from other engines
when one queue over all engines would admit them next.

Routing happens once, at arrival, by the load the router sees then; after that each engine's admission
order chooses only among the requests queued on that engine. So a tenant whose requests wait on a busy
or slow engine would fall behind while a faster engine serves the tenants queued there, and the shared
counters could not help it: a tenant's service would depend on where it was routed. (The cluster
fairness property test found it: a tenant kept on the slower of two engines by its adapter's affinity
fell behind without bound.) So before an engine plans, `plan_steals` fills its free batch slots the way
one VTC queue over all engines would:

1. requests overdue (waited past the TTFT guard) on another engine, oldest first;
2. then, slot by slot, the tenant with the smallest counter among those with a request waiting here or
   stealable elsewhere, its counter raised by the prompt charge admission will make (so a tenant takes
   the slots its counter allows, not all of them); its request here if it has one, else its oldest
   stealable one.

Stealable: waiting on another engine beyond that engine's own free slots (it would wait there), never
admitted (no K/V, no slot, nothing sent). The request moves as it is: its arrival time stays (its TTFT
runs on), its prompt is charged once, on admission. Adapter and prefix affinity are given up for it:
being served beats being served nearby.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from coserve.cluster.member import EngineMember
from coserve.inference.request import Request
from coserve.tenancy.vtc import VirtualTokenCounter

Steal = tuple[Request, EngineMember]


def plan_steals(thief: EngineMember, members: Iterable[EngineMember], vtc: VirtualTokenCounter, now: float,
                guard_s: float) -> list[Steal]:
    """The requests `thief` should take before it plans, each with the engine it waits on (module
    docstring); empty when it has no free slot or nothing waits elsewhere."""
    slots = thief.free_slots
    if slots == 0:
        return []
    victims = [m for m in members if m is not thief and m.policy.num_waiting > m.free_slots]
    if not victims:
        return []
    remote: dict[str, list[Steal]] = {}  # tenant -> its stealable requests, oldest first
    for victim in victims:
        for tenant, queued in victim.unsent.items():
            remote.setdefault(tenant, []).extend((r, victim) for r in queued.values() if thief.fits(r))
    steals = _overdue(remote, now - guard_s, slots)
    slots -= len(steals)
    if slots > 0:
        steals += _by_counters(thief, remote, vtc, slots)
    return steals


def can_steal(thief: EngineMember, members: Iterable[EngineMember]) -> bool:
    """Whether `plan_steals` would find something for `thief` (a free slot, and a request waiting on
    another engine beyond its free slots that fits `thief`): an idle engine has work after all."""
    if thief.free_slots == 0:
        return False
    return any(m is not thief and m.policy.num_waiting > m.free_slots
               and any(thief.fits(r) for queued in m.unsent.values() for r in queued.values())
               for m in members)


def _overdue(remote: dict[str, list[Steal]], cutoff: float, slots: int) -> list[Steal]:
    """Up to `slots` stealable requests that arrived by `cutoff`, oldest first (taken out of `remote`)."""
    overdue = sorted((s for stealable in remote.values() for s in stealable if s[0].arrival_time <= cutoff),
                     key=lambda s: (s[0].arrival_time, s[0].request_id))[:slots]
    for steal in overdue:
        remote[steal[0].tenant].remove(steal)
    return overdue


def _by_counters(thief: EngineMember, remote: dict[str, list[Steal]], vtc: VirtualTokenCounter,
                 slots: int) -> list[Steal]:
    """Simulate `slots` admissions of one VTC queue over the local and the stealable requests."""
    for stealable in remote.values():
        stealable.sort(key=lambda s: (s[0].arrival_time, s[0].request_id))
    local = {t: list(q.values()) for t, q in thief.unsent.items()}
    if not any(remote.values()):
        return []
    w_p = vtc.weights.w_p
    heap = [(vtc.counter(t), t) for t in set(local) | {t for t, s in remote.items() if s}]
    heapq.heapify(heap)
    taken: list[Steal] = []
    for _ in range(slots):
        if not heap:
            break
        counter, tenant = heapq.heappop(heap)
        here, there = local.get(tenant), remote.get(tenant)
        if here:
            request = here.pop(0)
        else:
            assert there
            request = there[0][0]
            taken.append(there.pop(0))
        if here or there:
            cost = w_p * len(request.prompt_token_ids) / vtc.weight(tenant)
            heapq.heappush(heap, (counter + cost, tenant))
    return taken
