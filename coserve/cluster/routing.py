"""Which engine a new request goes to: the least loaded, with affinity for its adapter and its prefix.

The router reads each candidate engine through `RouteCandidate` (the cluster's `EngineMember` is one)
and scores it in one unit, *batches of queued work*:

* load (`EngineLoad.pressure`): the engine's unfinished requests per batch slot (`max_num_seqs`),
  plus the prompt tokens still to prefill per iteration budget (`max_batch_tokens`);
* minus the prefill a cached prefix saves there: its cached leading tokens per iteration budget, times
  `RoutingWeights.prefix_affinity`. A sequence of a fan-out (n > 1) counts its whole prompt on the
  engine its siblings went to: the first one's prefill fills that cache;
* minus `adapter_affinity` where the request's adapter is resident or already asked for (no load, no
  slot churn), plus `adapter_wait` where it is neither and every adapter slot is pinned (the request
  would wait for a slot).

The lowest score wins; ties go to the lower load, then to the engine id (deterministic). Affinity is a
preference, never a pin: once the engine holding an adapter is more loaded than another by more than
the bonus, the adapter's requests go elsewhere and load it there too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from coserve.contract.sampling import AdapterRef
from coserve.inference.prefix_hashes import PrefixHashes
from coserve.inference.request import Request
from coserve.inference.request_rules import prefix_salt


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the router and the job placer read of one engine at one moment."""

    unfinished: int  # requests routed here that have not finished
    awaiting_prefill_tokens: int  # prompt tokens of those that have not produced a token yet
    max_num_seqs: int
    max_batch_tokens: int
    free_kv_blocks: int  # of the KV range fine-tuning jobs allocate from
    num_jobs: int  # fine-tuning jobs placed here (running or paused)
    job_weight: float  # the VTC weights of their tenants, summed

    @property
    def pressure(self) -> float:
        """Batches of queued work: requests per batch slot plus iterations of prefill still to run."""
        return self.unfinished / self.max_num_seqs + self.awaiting_prefill_tokens / self.max_batch_tokens


class RouteCandidate(Protocol):
    """An engine as the router sees it."""

    @property
    def engine_id(self) -> str: ...

    @property
    def block_size(self) -> int:
        """Tokens per block of its KV cache (prefix hashes are per block size)."""

    def load(self) -> EngineLoad: ...

    def holds_adapter(self, adapter_id: int) -> bool:
        """Whether the adapter is resident in a slot, or a request routed here asked for it."""

    def can_take_adapter(self, adapter: AdapterRef) -> bool:
        """Whether the adapter could get a slot now (resident, or a slot free or unpinned)."""

    def cached_prefix_blocks(self, prefix: PrefixHashes) -> int:
        """Leading full blocks of `prefix` in this engine's prefix cache."""

    def holds_fanout(self, parent_id: str) -> bool:
        """Whether a sequence of this fan-out was routed here."""


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    """How much the router trades load for affinity, in batches of queued work (module docstring).

    Raises:
        ValueError: a weight is negative.
    """

    adapter_affinity: float = 0.25
    adapter_wait: float = 1.0
    prefix_affinity: float = 1.0

    def __post_init__(self) -> None:
        for name in ("adapter_affinity", "adapter_wait", "prefix_affinity"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RoutingWeights.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """The router's answer: the engine, its score, and what affinity it found there."""

    engine_id: str
    score: float
    adapter_resident: bool
    prefix_tokens: int  # prompt tokens counted as cached there (a fan-out sibling's: the whole prompt)


def route(request: Request, candidates: Sequence[RouteCandidate],
          weights: RoutingWeights = RoutingWeights()) -> RouteChoice:
    """The engine for `request` among `candidates` (module docstring).

    Raises:
        ValueError: no candidate.
    """
    if not candidates:
        raise ValueError(f"no engine to route request {request.request_id!r} to")
    probes: dict[int, PrefixHashes] = {}  # block size -> the prompt's chain, hashed once
    best: tuple[float, float, str] | None = None
    choice: RouteChoice | None = None
    for engine in candidates:
        load = engine.load()
        pressure = load.pressure
        score, resident = pressure, False
        adapter = request.adapter
        if adapter is not None:
            resident = engine.holds_adapter(adapter.adapter_id)
            if resident:
                score -= weights.adapter_affinity
            elif not engine.can_take_adapter(adapter):
                score += weights.adapter_wait
        cached = _cached_tokens(request, engine, probes)
        score -= weights.prefix_affinity * cached / load.max_batch_tokens
        key = (score, pressure, engine.engine_id)
        if best is None or key < best:
            best = key
            choice = RouteChoice(engine.engine_id, score, resident, cached)
    assert choice is not None
    return choice


def _cached_tokens(request: Request, engine: RouteCandidate, probes: dict[int, PrefixHashes]) -> int:
    """Prompt tokens the engine would not prefill: its cached prefix, or the whole prompt for a sequence
    whose fan-out siblings went there."""
    prompt = request.prompt_token_ids
    if request.parent_id is not None and engine.holds_fanout(request.parent_id):
        return len(prompt)
    block_size = engine.block_size
    probe = probes.get(block_size)
    if probe is None:
        probe = probes[block_size] = PrefixHashes(prompt, prefix_salt(request), block_size)
    return engine.cached_prefix_blocks(probe) * block_size
