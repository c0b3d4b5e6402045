"""What happens to a lost engine's work (`EngineCluster.engine_lost`), and the record of it.

* A request that has not produced a token yet is re-routed: nothing of it reached its client, so it
  starts over on another engine (its prompt is not charged twice: `shared_vtc`). The oldest go first.
  With no engine left it waits in the cluster until one joins.
* A request that has produced tokens cannot move (its sampled tokens, stop state and stream are tied
  to the K/V the lost engine held): it is *stranded*, and the caller ends its stream with an error that
  says so.
* A fine-tuning job is placed again (`job_placement`) and resumes from its last confirmed checkpoint
  (`job_checkpoints`), or starts over when it had none; with no engine that can hold it, it waits with
  the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from coserve.inference.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class JobMove:
    """Where a lost engine's job went.

    Attributes:
        to_engine: its new engine; None: it waits (`reason`).
        resumed_from: the checkpoint folder it resumes from; None: it starts over.
    """

    job_id: str
    from_engine: str
    to_engine: str | None
    resumed_from: str | None
    reason: str | None = None


@dataclass(slots=True)
class Failover:
    """What `engine_lost` did with the engine's work (module docstring)."""

    engine_id: str
    rerouted: dict[str, str] = field(default_factory=dict)  # request id -> its new engine
    waiting: list[str] = field(default_factory=list)  # re-routable, no engine left: held until one joins
    stranded: list[Request] = field(default_factory=list)  # produced tokens: end their streams
    jobs: list[JobMove] = field(default_factory=list)


def split_requests(requests: Iterable[Request]) -> tuple[list[Request], list[Request]]:
    """(re-routable, stranded): requests without an output token, oldest first, and the others."""
    reroutable: list[Request] = []
    stranded: list[Request] = []
    for request in requests:
        (stranded if request.num_output_tokens else reroutable).append(request)
    reroutable.sort(key=lambda r: (r.arrival_time, r.request_id))
    return reroutable, stranded


def reset_for_reroute(request: Request) -> None:
    """Make a request that produced no token new again: waiting, nothing computed."""
    if request.num_output_tokens:
        raise ValueError(f"request {request.request_id!r} produced tokens; it cannot be re-routed")
    request.status = RequestStatus.WAITING
    request.num_computed_tokens = 0
