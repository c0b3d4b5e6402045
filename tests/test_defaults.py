"""Every config that takes a server size takes its default from `coserve.contract.defaults`: the
scheduler's budgets, the engine's block and adapter bank sizes, the CLI flags, the offline `LLM`."""

from __future__ import annotations

import dataclasses
import inspect

from coserve.actors.scheduler_actor import SchedulerSettings
from coserve.cli import build_parser
from coserve.cluster.policy_factory import CoServingPolicyFactory
from coserve.contract import defaults
from coserve.contract.engine_config import EngineConfig
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.finetune.dedicated import DedicatedSettings
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.offline.llm import LLM
from coserve.planner.settings import CoServingConfig
from coserve.server.options import ServeOptions


def _field_defaults(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_configs_take_the_shared_defaults() -> None:
    scheduler = SchedulerConfig(max_model_len=128)
    assert (scheduler.max_num_seqs, scheduler.max_batch_tokens, scheduler.block_size) == \
        (defaults.MAX_NUM_SEQS, defaults.MAX_BATCH_TOKENS, defaults.BLOCK_SIZE)
    assert CoServingConfig(scheduler=scheduler).finetune_min_share == defaults.FINETUNE_MIN_SHARE
    assert _field_defaults(CoServingPolicyFactory)["finetune_min_share"] == defaults.FINETUNE_MIN_SHARE
    settings = SchedulerSettings(model="m")
    assert (settings.max_num_seqs, settings.max_batch_tokens) == (defaults.MAX_NUM_SEQS,
                                                                  defaults.MAX_BATCH_TOKENS)
    engine = EngineConfig(model="m")
    assert (engine.block_size, engine.max_loras, engine.max_lora_rank) == \
        (defaults.BLOCK_SIZE, defaults.ADAPTER_SLOTS, defaults.MAX_LORA_RANK)
    opts = ServeOptions(model="m", tenants="t.yaml")
    assert (opts.max_num_seqs, opts.max_batch_tokens, opts.adapter_slots, opts.finetune_min_share) == \
        (defaults.MAX_NUM_SEQS, defaults.MAX_BATCH_TOKENS, defaults.ADAPTER_SLOTS,
         defaults.FINETUNE_MIN_SHARE)
    assert opts.dedicated_pause_timeout_s == DedicatedSettings().pause_timeout_s == defaults.DEDICATED_PAUSE_TIMEOUT_S
    assert FinetuneJobSpec.__dataclass_fields__["max_window_tokens"].default == defaults.FINETUNE_WINDOW_TOKENS


def test_the_cli_and_the_offline_llm_take_the_shared_defaults() -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--tenants", "t.yaml"])
    assert (args.max_num_seqs, args.max_batch_tokens, args.adapter_slots, args.finetune_min_share,
            args.dedicated_pause_timeout_s) == \
        (defaults.MAX_NUM_SEQS, defaults.MAX_BATCH_TOKENS, defaults.ADAPTER_SLOTS,
         defaults.FINETUNE_MIN_SHARE, defaults.DEDICATED_PAUSE_TIMEOUT_S)
    llm = inspect.signature(LLM).parameters
    assert (llm["max_num_seqs"].default, llm["block_size"].default, llm["max_loras"].default,
            llm["max_lora_rank"].default) == (defaults.MAX_NUM_SEQS, defaults.BLOCK_SIZE,
                                              defaults.ADAPTER_SLOTS, defaults.MAX_LORA_RANK)
