"""Which scheduling policy each engine of a SchedulerActor runs, built once the engine's layout is known.

`PolicyFactory(config, layout, shared) -> policy`, over the cluster's shared virtual token counters.
Factories are plain picklable callables: in Ray mode the scheduler receives them in its own process.
`CoServingPolicyFactory` (what `coserve serve` uses) builds the co-serving policy with a fine-tuning
share (the hybrid share by default; none: inference only) and the latency model of a profile file
(`coserve profile --json`), refused when it was fitted for another model, machine or dtype, or an
unfitted one that learns the iteration costs online from every measured iteration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from coserve.contract import defaults
from coserve.contract.engine import TokenizerSpec
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel, ModelFingerprint
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS, CoServingConfig
from coserve.planner.share_kinds import ShareKind, ShareOptions, build_policy
from coserve.tenancy.shared_vtc import SharedVtc


class EngineLayout(Protocol):
    """What the scheduler reads of an engine's `RuntimeLayout` (read-only: a layout is a frozen value)."""

    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_adapter_slots(self) -> int: ...
    @property
    def max_lora_rank(self) -> int: ...
    @property
    def tokenizer(self) -> TokenizerSpec | None: ...
    @property
    def engine_owns_kv_cache(self) -> bool: ...
    @property
    def structured_output(self) -> bool: ...


class PolicyFactory(Protocol):
    """Builds one engine's policy over the cluster's shared counters (`CoServingPolicyFactory`)."""

    @property
    def tenant_weights(self) -> Mapping[str, float]:
        """Tenant -> share under contention (the cluster's counters weigh tenants with them)."""

    def __call__(self, config: SchedulerConfig, layout: EngineLayout, shared: SharedVtc) -> CoServingPolicy: ...


@dataclass(frozen=True, slots=True)
class CoServingPolicyFactory:
    """Builds a `CoServingPolicy` (inference first in VTC order, fine-tuning in what is left) with the
    fine-tuning share `share` (default: the hybrid share, up to the TPOT SLO).

    Args:
        fingerprint: the served model, this machine and the dtype (a profile must match it).
        tpot_slo_ms / ttft_slo_ms: the SLOs (None: `CoServingConfig`'s defaults).
        max_stall_ms: fine-tuning bursts that spend the requests' TPOT slack, no token gap longer
            (`CoServingConfig.max_stall_ms`); None: every iteration within the TPOT SLO.
        latency_profile: a `coserve profile --json` file; None starts unfitted (learned online).
        tenant_weights: tenant -> share under contention (the tenants file's `weight`).
        finetune_min_share: fine-tuning's least share of an engine's time while a job is runnable
            (`CoServingConfig.finetune_min_share`).
        share / share_options: the fine-tuning share strategy (`share_kinds`); with
            `ShareKind.NONE` the policy runs no jobs (the scheduler opens no job manager).
        max_backward_token_layers: backward work an iteration may hold at most
            (`CoServingConfig.max_backward_token_layers`; None: its default).
    """

    fingerprint: ModelFingerprint
    tpot_slo_ms: float | None = None
    ttft_slo_ms: float | None = None
    latency_profile: str | None = None
    max_stall_ms: float | None = None
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    finetune_min_share: float = defaults.FINETUNE_MIN_SHARE
    share: ShareKind = ShareKind.HYBRID
    share_options: ShareOptions = ShareOptions()
    max_backward_token_layers: int | None = None

    def latency_model(self) -> LatencyModel:
        """The profile's model, checked against this server; or an unfitted one.

        Raises:
            ValueError: the profile is unreadable or was fitted for another model, machine or dtype.
        """
        if self.latency_profile is None:
            return LatencyModel(self.fingerprint)
        try:
            model = LatencyModel.from_json(Path(self.latency_profile).read_text())
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"--latency-profile {self.latency_profile}: {err}") from err
        model.check_compatible(self.fingerprint)
        return model

    def __call__(self, config: SchedulerConfig, layout: EngineLayout,
                 shared: SharedVtc | None = None) -> CoServingPolicy:
        """The policy of one engine; with `shared`, one of several engines counting with a
        `EngineCluster`'s counters (each engine its own latency model, fitted on its own iterations)."""
        co = CoServingConfig(scheduler=config, tenant_weights=dict(self.tenant_weights),
                             max_stall_ms=self.max_stall_ms, finetune_min_share=self.finetune_min_share,
                             tpot_slo_ms=DEFAULT_TPOT_SLO_MS if self.tpot_slo_ms is None else self.tpot_slo_ms,
                             ttft_slo_ms=DEFAULT_TTFT_SLO_MS if self.ttft_slo_ms is None else self.ttft_slo_ms)
        if self.max_backward_token_layers is not None:
            co = dataclasses.replace(co, max_backward_token_layers=self.max_backward_token_layers)
        return build_policy(self.share, co, layout.num_kv_blocks, AdapterSlots(layout.num_adapter_slots),
                            self.latency_model(), self.share_options, shared=shared)
