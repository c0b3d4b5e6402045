"""`SharedVtc`: one set of virtual token counters for the policies of several engines.

A `CoServingPolicy` alone keeps its own counters. Under an `EngineCluster` (`cluster/engine_cluster.py`) every
engine's policy charges and selects with the same `VirtualTokenCounter`, so a tenant's service is
counted over the whole machine: the input, output and fine-tuning tokens it got on any engine raise
the one counter that every engine's admission order and job roster reads.

Two things a counter shared by several queues needs besides the counts:

* **Backlog over all engines.** A tenant is backlogged (FlexLLM's Q) while it has a queued request or
  a runnable job on *any* engine. Each policy reports the tenant's backlog when its own queue or jobs
  change (`JobHost.sync_backlog`), asking `backlogged(tenant)` instead of its own queue alone, so the
  counter's backlogged set is the union over engines and the lift applies once, when the tenant comes
  back to the machine (not when it reaches a second engine).
* **A prompt is charged once.** `input_charged` holds the requests whose prompt was charged; a
  request re-routed to another engine after its engine was lost (it had produced no token) is not
  charged again when it is admitted there, as a request recomputed after a preemption is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from coserve.tenancy.vtc import VirtualTokenCounter


@dataclass(frozen=True, slots=True)
class SharedVtc:
    """The counters several engines' policies share (module docstring).

    Attributes:
        vtc: the counters; their `weights` must equal each policy's `CoServingConfig.vtc`.
        backlogged: whether the tenant has a queued request or a runnable job on any engine.
        input_charged: ids of the requests whose prompt was charged (on whichever engine).
    """

    vtc: VirtualTokenCounter
    backlogged: Callable[[str], bool]
    input_charged: set[str] = field(default_factory=set)
