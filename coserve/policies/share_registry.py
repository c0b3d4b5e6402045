"""The fine-tuning share strategies by name: an enum of the kinds and one typed factory per kind.

    share = make_share(share_kind("temporal"), config, ShareOptions(inference_iterations=128))
    policy = CoServingPolicy(config, kv, adapters, latency, share=share)

A static split also needs the KV cache cut in two (`static_split.split_kv`): `ShareOptions` carries
the fraction, and `CoServingPolicy` is given the fine-tuning range as `finetune_kv`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from coserve.policies.dynamic_temporal import dynamic_temporal_share
from coserve.policies.finetune_share import FinetuneShare, NoFinetuneShare
from coserve.policies.hybrid import HybridShare
from coserve.policies.hybrid_config import CoServingConfig
from coserve.policies.static_split import DEFAULT_FINETUNE_FRACTION, StaticSplitShare
from coserve.policies.temporal import DEFAULT_INFERENCE_ITERATIONS, temporal_share


class ShareKind(enum.Enum):
    """The fine-tuning share strategies (`finetune_share`)."""

    HYBRID = "hybrid"  # what the latency model says fits under the TPOT SLO (the default)
    TEMPORAL = "temporal"  # a fine-tuning iteration every `inference_iterations`
    DYNAMIC_TEMPORAL = "dynamic-temporal"  # FlexLLM Algorithm 3's adaptive interval
    STATIC_SPLIT = "static-split"  # `finetune_fraction` of every iteration and of the KV cache
    NONE = "none"  # inference only; no jobs


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
