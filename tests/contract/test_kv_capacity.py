"""The start-up check of the KV cache: one `max_model_len` sequence plus one fine-tuning window, or a
refusal that says what the cache holds, what is needed and which flag to change."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coserve.contract.defaults import FINETUNE_WINDOW_TOKENS
from coserve.contract.engine import EngineStartError, RuntimeLayout
from coserve.contract.kv_capacity import KvCacheTooSmall, check_kv_capacity, kv_capacity_refusal


def test_one_sequence_and_one_window_is_enough_and_one_token_less_is_not() -> None:
    assert FINETUNE_WINDOW_TOKENS == 256  # the numbers below
    assert kv_capacity_refusal(2048 + 256, 2048) is None
    assert kv_capacity_refusal(2048 + 255, 2048) is not None
    assert kv_capacity_refusal(600, 512, window_tokens=88) is None


def test_the_refusal_says_what_fits_and_which_flag_to_change() -> None:
    assert kv_capacity_refusal(1000, 2048) == (
        "the KV cache holds 1000 tokens, and serving needs at least 2304: one sequence of --max-model-len 2048 "
        "plus one fine-tuning window of 256 tokens. Raise --kv-cache-memory-gb (or --gpu-memory-utilization on "
        "CUDA), or lower --max-model-len to at most 744")
    tiny = kv_capacity_refusal(200, 64)
    assert tiny is not None and tiny.endswith("Raise --kv-cache-memory-gb (or --gpu-memory-utilization on CUDA): "
                                              "no --max-model-len fits beside a fine-tuning window")


def test_an_engine_layout_is_checked_in_whole_blocks() -> None:
    """62 blocks of 16 hold 992 positions: short of 744 + 256; 63 hold 1008."""
    layout = RuntimeLayout(num_kv_blocks=62, block_size=16, max_model_len=744, vocab_size=100,
                           num_adapter_slots=1, max_lora_rank=8)
    with pytest.raises(KvCacheTooSmall, match=r"^the KV cache holds 992 tokens, and serving needs at least 1000"):
        check_kv_capacity(layout)
    assert issubclass(KvCacheTooSmall, EngineStartError)  # `coserve serve` prints it and exits 1
    check_kv_capacity(replace(layout, num_kv_blocks=63))
