"""`SchedulerSettings`: how to build a `SchedulerActor`, plain data sent to the actor's process."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from coserve.actors.metrics import Slo
from coserve.cluster.policy_factory import EngineLayout
from coserve.contract import defaults
from coserve.finetune.dedicated import DedicatedSettings
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.tenancy.quotas import TenantLimits


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """How to build a SchedulerActor (plain data: it is sent to the actor's process).

    Args:
        model: the base model folder (its config; the job manager tokenizes training files with its
            tokenizer).
        max_num_seqs / max_batch_tokens / enable_prefix_caching: the policy's budgets.
        tenant_limits: requests/min and tokens/min per tenant (absent: unlimited).
        slo: latency objectives for the SLO attainment metrics.
    """

    model: str
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_batch_tokens: int = defaults.MAX_BATCH_TOKENS
    enable_prefix_caching: bool = True
    tenant_limits: Mapping[str, TenantLimits] = field(default_factory=dict)
    slo: Slo = Slo()
    data_dir: str | None = None  # the metadata store's folder: fine-tuning jobs run when it is set
    base_model_id: str = ""  # the base model's public id (fine-tuned ids start `ft:{base}:`)
    dedicated: DedicatedSettings | None = None  # fine-tuning on Ray Train runs of their own (None: no Ray)
    enable_python_graders: bool = False  # reinforcement jobs may grade with `python` graders

    def scheduler_config(self, layout: EngineLayout) -> SchedulerConfig:
        """An engine policy's config over that engine's layout (an engine that keeps its own KV cache,
        vLLM, has its own prefix cache)."""
        return SchedulerConfig(max_model_len=layout.max_model_len, max_num_seqs=self.max_num_seqs,
                               max_batch_tokens=self.max_batch_tokens, block_size=layout.block_size,
                               enable_prefix_caching=self.enable_prefix_caching and not layout.engine_owns_kv_cache)
