"""The policies the co-serving benchmark compares, by name, built the same way for replay and simulation.

Names (the `policy` field of the benchmark's JSON):

* ``coserve``: the hybrid share (`HybridShare`), token-level co-serving (ours), with the setup's
  `max_stall_ms` (fine-tuning bursts that spend the requests' TPOT slack).
* ``coserve-strict``: the same policy with every iteration within the TPOT SLO (no bursts; FlexLLM's
  rule).
* ``temporal-n{n}``: temporal sharing (`temporal_share`), n inference iterations per fine-tuning
  iteration.
* ``dynamic-temporal``: dynamic temporal sharing (`dynamic_temporal_share`, FlexLLM Appendix A).
* ``static-split-{f}``: a static split (`StaticSplitShare`), a fraction f of every iteration and of the
  KV cache for fine-tuning.

Every policy gets the same scheduler limits, SLOs and a private copy of the fitted latency model (each
refines its own copy online). Every one is a `CoServingPolicy` with a share strategy, built by
`share_kinds.build_policy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coserve.bench.replay import PolicyFactory
from coserve.bench.run_metrics import SLO
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import DEFAULT_BURST_MARGIN, CoServingConfig
from coserve.planner.share_kinds import ShareKind, ShareOptions, build_policy
from coserve.tenancy.shared_vtc import SharedVtc


@dataclass(frozen=True, slots=True)
class PolicySetup:
    """What every policy of a benchmark shares."""

    scheduler: SchedulerConfig
    slo: SLO
    latency: LatencyModel
    safety_margin: float = 0.1
    max_stall_ms: float | None = None  # coserve's bursts (`CoServingConfig.max_stall_ms`)
    strict_safety_margin: float | None = None  # coserve-strict's (None: `safety_margin`)
    burst_margin: float = DEFAULT_BURST_MARGIN  # coserve's bursts (`CoServingConfig.burst_margin`)

    def config(self, max_stall_ms: float | None = None,
               safety_margin: float | None = None) -> CoServingConfig:
        margin = self.safety_margin if safety_margin is None else safety_margin
        return CoServingConfig(scheduler=self.scheduler, tpot_slo_ms=self.slo.tpot_s * 1000.0,
                               ttft_slo_ms=self.slo.ttft_s * 1000.0, safety_margin=margin,
                               max_stall_ms=max_stall_ms, burst_margin=self.burst_margin)

    def latency_copy(self) -> LatencyModel:
        return LatencyModel.from_dict(self.latency.to_dict())


def make_factory(name: str, setup: PolicySetup) -> PolicyFactory:
    """The factory of the policy called `name` (module docstring). Raises ValueError when unknown."""
    config = setup.config()

    if name in ("coserve", "coserve-strict"):
        hybrid = setup.config(setup.max_stall_ms) if name == "coserve" else \
            setup.config(safety_margin=setup.strict_safety_margin)
        return _factory(setup, hybrid, ShareKind.HYBRID, ShareOptions())
    if name == "dynamic-temporal":
        return _factory(setup, config, ShareKind.DYNAMIC_TEMPORAL, ShareOptions())
    if name.startswith("temporal-n"):
        options = ShareOptions(inference_iterations=int(_parse(name, "temporal-n", int)))
        return _factory(setup, config, ShareKind.TEMPORAL, options)
    if name.startswith("static-split-"):
        options = ShareOptions(finetune_fraction=float(_parse(name, "static-split-", float)))
        return _factory(setup, config, ShareKind.STATIC_SPLIT, options)
    raise ValueError(f"unknown policy {name!r}: use coserve, coserve-strict, temporal-n<N>, "
                     "dynamic-temporal or static-split-<fraction>")


def _factory(setup: PolicySetup, config: CoServingConfig, kind: ShareKind,
             options: ShareOptions) -> PolicyFactory:
    """A factory of policies with a fresh share of `kind` and a private copy of the latency model."""

    def build(num_blocks: int, block_size: int, adapters: AdapterSlots, clock: Callable[[], float], *,
              shared: SharedVtc | None = None) -> CoServingPolicy:
        if block_size != config.scheduler.block_size:
            raise ValueError(f"the engine's KV blocks hold {block_size} tokens, the benchmark's "
                             f"SchedulerConfig.block_size is {config.scheduler.block_size}")
        return build_policy(kind, config, num_blocks, adapters, setup.latency_copy(), options, clock=clock,
                            shared=shared)
    return build


def _parse(name: str, prefix: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(name[len(prefix):])
    except ValueError as exc:
        raise ValueError(f"bad policy name {name!r}: expected {prefix}<{kind.__name__}>") from exc
