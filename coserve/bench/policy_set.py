"""The policies the co-serving benchmark compares, by name, built the same way for replay and simulation.

Names (the `policy` field of the benchmark's JSON):

* ``coserve``: `HybridTokenPolicy`, token-level co-serving (ours), with the setup's `max_stall_ms`
  (fine-tuning bursts that spend the requests' TPOT slack).
* ``coserve-strict``: the same policy with every iteration within the TPOT SLO (no bursts; FlexLLM's
  rule).
* ``temporal-n{n}``: `TemporalSharingPolicy`, n inference iterations per fine-tuning iteration.
* ``dynamic-temporal``: `DynamicTemporalSharingPolicy` (FlexLLM Appendix A).
* ``static-split-{f}``: `StaticSplitPolicy`, a fraction f of every iteration and of the KV cache for
  fine-tuning.

Every policy gets the same scheduler limits, SLOs and a private copy of the fitted latency model (each
refines its own copy online).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coserve.bench.metrics import SLO
from coserve.bench.replay import PolicyFactory
from coserve.policies.adapter_slots import AdapterSlots
from coserve.policies.config import SchedulerConfig
from coserve.policies.coserving import CoServingPolicy
from coserve.policies.dynamic_temporal import DynamicTemporalSharingPolicy
from coserve.policies.hybrid import HybridTokenPolicy
from coserve.policies.hybrid_config import CoServingConfig
from coserve.policies.kv_blocks import KVBlockManager
from coserve.policies.latency import LatencyModel
from coserve.policies.static_split import StaticSplitPolicy, split_kv
from coserve.policies.temporal import TemporalSharingPolicy


@dataclass(frozen=True, slots=True)
class PolicySetup:
    """What every policy of a benchmark shares."""

    scheduler: SchedulerConfig
    slo: SLO
    latency: LatencyModel
    safety_margin: float = 0.1
    max_stall_ms: float | None = None  # coserve's bursts (`CoServingConfig.max_stall_ms`)
    strict_safety_margin: float | None = None  # coserve-strict's (None: `safety_margin`)

    def config(self, max_stall_ms: float | None = None,
               safety_margin: float | None = None) -> CoServingConfig:
        margin = self.safety_margin if safety_margin is None else safety_margin
        return CoServingConfig(scheduler=self.scheduler, tpot_slo_ms=self.slo.tpot_s * 1000.0,
                               ttft_slo_ms=self.slo.ttft_s * 1000.0, safety_margin=margin,
                               max_stall_ms=max_stall_ms)

    def latency_copy(self) -> LatencyModel:
        return LatencyModel.from_dict(self.latency.to_dict())


def _kv(num_blocks: int, block_size: int) -> KVBlockManager:
    return KVBlockManager(num_blocks, block_size, enable_prefix_caching=True)


def make_factory(name: str, setup: PolicySetup) -> PolicyFactory:
    """The factory of the policy called `name` (module docstring). Raises ValueError when unknown."""
    config = setup.config()

    if name in ("coserve", "coserve-strict"):
        hybrid = setup.config(setup.max_stall_ms) if name == "coserve" else \
            setup.config(safety_margin=setup.strict_safety_margin)
        return (lambda n, bs, ad, clock: HybridTokenPolicy(
            hybrid, _kv(n, bs), ad, setup.latency_copy(), clock=clock))
    if name == "dynamic-temporal":
        return (lambda n, bs, ad, clock: DynamicTemporalSharingPolicy(
            config, _kv(n, bs), ad, setup.latency_copy(), clock=clock))
    if name.startswith("temporal-n"):
        interval = _parse(name, "temporal-n", int)
        return (lambda n, bs, ad, clock: TemporalSharingPolicy(
            config, _kv(n, bs), ad, setup.latency_copy(), inference_iterations=interval, clock=clock))
    if name.startswith("static-split-"):
        fraction = _parse(name, "static-split-", float)

        def static(n: int, bs: int, ad: AdapterSlots, clock: Callable[[], float]) -> CoServingPolicy:
            inference, finetune = split_kv(n, bs, fraction)
            return StaticSplitPolicy(config, inference, finetune, ad, setup.latency_copy(),
                                     finetune_fraction=fraction, clock=clock)
        return static
    raise ValueError(f"unknown policy {name!r}: use coserve, coserve-strict, temporal-n<N>, "
                     "dynamic-temporal or static-split-<fraction>")


def _parse(name: str, prefix: str, kind: type) -> int | float:
    try:
        return kind(name[len(prefix):])
    except ValueError as exc:
        raise ValueError(f"bad policy name {name!r}: expected {prefix}<{kind.__name__}>") from exc
