"""Which engine a fine-tuning job runs on: one that has the memory for it, the least loaded with jobs.

A job runs on one engine: its trainable adapter, optimizer state and kept activations live there, in
that engine's adapter bank and KV cache. `place_job` keeps the engines that can hold it at all

* memory: its longest sequence (training or validation) fits the KV blocks jobs may use there (a
  sequence's blocks are allocated window by window, and a sequence longer than the range never fits);
* an adapter slot: fewer jobs claiming one there than adapter slots (each job pins one for its adapter;
  a training run driven by its client claims one only while it has a call to do, `slot_claims`, and is
  placed whatever the slots: it takes one for each call, or its call waits saying why, `run_parking`);

and picks the one with the least fine-tuning on it (the VTC weights of its jobs' tenants, summed: each
engine's leftover capacity is shared by the jobs there in counter order), then the lowest inference
load (`EngineLoad.pressure`), then the most free KV blocks, then the engine id. When no engine can hold
the job, the answer says why, so the job waits with that reason instead of silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from coserve.cluster.routing import EngineLoad
from coserve.contract.job_spec import FinetuneJobSpec


class PlacementCandidate(Protocol):
    """An engine as the job placer sees it."""

    @property
    def engine_id(self) -> str: ...

    def load(self) -> EngineLoad: ...

    @property
    def hosts_jobs(self) -> bool:
        """Whether its policy runs fine-tuning jobs at all (a share of `none` runs none)."""

    @property
    def job_kv_blocks(self) -> int:
        """KV blocks fine-tuning jobs may allocate from there (the whole cache, or a static split's
        range)."""

    @property
    def job_block_size(self) -> int: ...

    @property
    def num_adapter_slots(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the job goes."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class Unplaced:
    """No engine can hold the job now; `reason` says why (for the job's events)."""

    reason: str


def longest_sequence(spec: FinetuneJobSpec) -> int:
    """Tokens of the job's longest sequence, training or validation."""
    return max((len(e.token_ids) for e in [*spec.examples, *spec.validation_examples]), default=2)


def place_job(spec: FinetuneJobSpec, candidates: Sequence[PlacementCandidate],
              slot_claims: Mapping[str, int] | None = None) -> Placement | Unplaced:
    """The engine for the job `spec` among `candidates` (module docstring); `slot_claims`: the jobs claiming
    an adapter slot on each engine (None: every job placed there)."""
    if not candidates:
        return Unplaced("no engine is running")
    hosting = [c for c in candidates if c.hosts_jobs]
    if not hosting:
        return Unplaced("no engine runs fine-tuning jobs (the fine-tuning share is `none`)")
    longest = longest_sequence(spec)
    fits = [c for c in hosting if -(-longest // c.job_block_size) <= c.job_kv_blocks]
    if not fits:
        most = max(c.job_kv_blocks * c.job_block_size for c in hosting)
        return Unplaced(f"a sequence of {longest} tokens needs more KV memory than any engine gives "
                        f"fine-tuning (at most {most} tokens)")
    loads = {c.engine_id: c.load() for c in fits}
    claims = {c.engine_id: loads[c.engine_id].num_jobs if slot_claims is None else slot_claims.get(c.engine_id, 0)
              for c in fits}
    free = fits if spec.driven else [c for c in fits if claims[c.engine_id] < c.num_adapter_slots]
    if not free:
        return Unplaced("every engine that fits the job has all its adapter slots taken by fine-tuning jobs "
                        "and training runs with calls to do; it starts when one of them is done with its slot")
    best = min(free, key=lambda c: (loads[c.engine_id].job_weight, loads[c.engine_id].pressure,
                                    -loads[c.engine_id].free_kv_blocks, c.engine_id))
    return Placement(best.engine_id)
