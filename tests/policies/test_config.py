"""SchedulerConfig validation, and its defaults as every entry point takes them."""

from __future__ import annotations

import dataclasses

import pytest

from coserve.policies.config import SchedulerConfig


def test_defaults() -> None:
    config = SchedulerConfig(max_model_len=128)
    assert (config.max_num_seqs, config.max_batch_tokens, config.block_size) == (64, 2048, 16)
    assert config.enable_prefix_caching and config.long_prefill_threshold == 0


@pytest.mark.parametrize("name", ["max_model_len", "max_num_seqs", "max_batch_tokens", "block_size"])
def test_budgets_below_one_name_the_setting(name: str) -> None:
    kwargs = {"max_model_len": 128, name: 0}
    with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
        SchedulerConfig(**kwargs)


def test_negative_threshold_rejected() -> None:
    with pytest.raises(ValueError, match="long_prefill_threshold.*-5"):
        SchedulerConfig(max_model_len=128, long_prefill_threshold=-5)


def test_frozen() -> None:
    config = SchedulerConfig(max_model_len=128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 3  # type: ignore[misc]


def test_every_entry_point_takes_the_scheduler_defaults_from_one_place() -> None:
    import inspect

    from coserve.actors.policy_setup import CoServingPolicyFactory
    from coserve.actors.scheduler import SchedulerSettings
    from coserve.cli import build_parser
    from coserve.llm import LLM
    from coserve.policies.config import (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH_TOKENS,
                                         DEFAULT_MAX_NUM_SEQS)
    from coserve.policies.hybrid_config import DEFAULT_FINETUNE_FLOOR_EVERY, CoServingConfig
    from coserve.serve import ServeOptions

    config = SchedulerConfig(max_model_len=64)
    assert (config.max_num_seqs, config.max_batch_tokens, config.block_size) == (
        DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_BATCH_TOKENS, DEFAULT_BLOCK_SIZE)
    for settings in (SchedulerSettings(model="m"), ServeOptions(model="m", tenants="t")):
        assert (settings.max_num_seqs, settings.max_batch_tokens) == (DEFAULT_MAX_NUM_SEQS,
                                                                      DEFAULT_MAX_BATCH_TOKENS)
    serve = build_parser().parse_args(["serve", "--model", "m", "--tenants", "t"])
    assert (serve.max_num_seqs, serve.max_batch_tokens, serve.finetune_floor_every) == (
        DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_BATCH_TOKENS, DEFAULT_FINETUNE_FLOOR_EVERY)
    llm = inspect.signature(LLM.__init__).parameters
    assert (llm["max_num_seqs"].default, llm["block_size"].default) == (DEFAULT_MAX_NUM_SEQS,
                                                                        DEFAULT_BLOCK_SIZE)
    assert CoServingConfig(scheduler=config).finetune_floor_every == DEFAULT_FINETUNE_FLOOR_EVERY
    assert ServeOptions(model="m", tenants="t").finetune_floor_every == DEFAULT_FINETUNE_FLOOR_EVERY
    factory_defaults = {f.name: f.default for f in dataclasses.fields(CoServingPolicyFactory)}
    assert factory_defaults["finetune_floor_every"] == DEFAULT_FINETUNE_FLOOR_EVERY
