"""The fine-tuning share strategies by name: an enum of the kinds and one typed factory per kind.

    policy = build_policy(share_kind("temporal"), config, num_blocks, adapters, latency,
                          ShareOptions(inference_iterations=128))

`build_policy` cuts the KV cache in two for a share that keeps a range of its own (a static split,
`static_split.split_kv`); `make_share` builds the strategy alone.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.planner.dynamic_temporal import dynamic_temporal_share
from coserve.planner.fill import FillShare
from coserve.planner.hybrid import HybridShare
from coserve.planner.latency import LatencyModel
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import CoServingConfig
from coserve.planner.static_split import DEFAULT_FINETUNE_FRACTION, StaticSplitShare, split_kv
from coserve.planner.strategy import FinetuneShare, NoFinetuneShare
from coserve.planner.temporal import DEFAULT_INFERENCE_ITERATIONS, temporal_share
from coserve.tenancy.shared_vtc import SharedVtc


class ShareKind(enum.Enum):
    """The fine-tuning share strategies (`strategy.FinetuneShare`)."""

    HYBRID = "hybrid"  # what the latency model says fits under the TPOT SLO (the default)
    TEMPORAL = "temporal"  # a fine-tuning iteration every `inference_iterations`
    DYNAMIC_TEMPORAL = "dynamic-temporal"  # FlexLLM Algorithm 3's adaptive interval
    STATIC_SPLIT = "static-split"  # `finetune_fraction` of every iteration and of the KV cache
    NONE = "none"  # inference only; no jobs
    FILL = "fill"  # no SLO: what inference leaves of each iteration (the offline `LLM`)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShareOptions:
    """The settings some strategies take (the others ignore them)."""

    inference_iterations: int = DEFAULT_INFERENCE_ITERATIONS
    """TEMPORAL: inference iterations per fine-tuning iteration (>= 1)."""

    finetune_fraction: float = DEFAULT_FINETUNE_FRACTION
    """STATIC_SPLIT: fine-tuning's share of each iteration's budgets and of the KV cache, in (0, 1)."""


ShareFactory = Callable[[CoServingConfig, ShareOptions], FinetuneShare]

SHARE_FACTORIES: Mapping[ShareKind, ShareFactory] = MappingProxyType({
    ShareKind.HYBRID: lambda config, options: HybridShare(),
    ShareKind.TEMPORAL: lambda config, options: temporal_share(options.inference_iterations),
    ShareKind.DYNAMIC_TEMPORAL: lambda config, options: dynamic_temporal_share(),
    ShareKind.STATIC_SPLIT: lambda config, options: StaticSplitShare(config, options.finetune_fraction),
    ShareKind.NONE: lambda config, options: NoFinetuneShare(),
    ShareKind.FILL: lambda config, options: FillShare(),
})


def share_kind(name: str) -> ShareKind:
    """The kind called `name`.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    try:
        return ShareKind(name)
    except ValueError:
        known = ", ".join(kind.value for kind in ShareKind)
        raise ValueError(f"unknown fine-tuning share {name!r}: use one of {known}") from None


def make_share(kind: ShareKind, config: CoServingConfig,
               options: ShareOptions = ShareOptions()) -> FinetuneShare:
    """A fresh strategy of `kind` for a policy planning with `config` (strategies keep state: one per
    policy).

    Raises:
        ValueError: `options` out of range for `kind` (the message names the setting).
    """
    return SHARE_FACTORIES[kind](config, options)


def build_policy(kind: ShareKind, config: CoServingConfig, num_blocks: int, adapters: AdapterSlots,
                 latency: LatencyModel, options: ShareOptions = ShareOptions(), *,
                 clock: Callable[[], float] = time.monotonic,
                 shared: SharedVtc | None = None) -> CoServingPolicy:
    """A co-serving policy with a fresh share of `kind`, over a KV cache of `num_blocks` blocks (of
    `config.scheduler.block_size` tokens), cut in two when the share keeps a range of its own; with
    `shared`, counting with the counters of a `EngineCluster` (`CoServingPolicy`).

    Raises:
        ValueError: `options` out of range for `kind`, or a KV range that would get no block.
    """
    share = make_share(kind, config, options)
    scheduler = config.scheduler
    if share.kv_fraction is None:
        kv = KVBlockManager(num_blocks, scheduler.block_size, scheduler.enable_prefix_caching)
        return CoServingPolicy(config, kv, adapters, latency, share=share, clock=clock, shared=shared)
    inference, finetune = split_kv(num_blocks, scheduler.block_size, share.kv_fraction,
                                   scheduler.enable_prefix_caching)
    return CoServingPolicy(config, inference, adapters, latency, share=share, finetune_kv=finetune,
                           clock=clock, shared=shared)
