"""SchedulerConfig validation (every entry point's defaults: tests/test_defaults.py)."""

from __future__ import annotations

import dataclasses

import pytest

from coserve.inference.scheduler_config import SchedulerConfig


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
