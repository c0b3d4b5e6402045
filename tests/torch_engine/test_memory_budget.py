"""How an engine's memory is split (`coserve.model.memory`, `coserve.torch_engine.memory_budget`,
`coserve.vllm.memory_share`): the sizes counted match the tensors the engine and the trainer really
allocate, and `--gpu-memory-utilization` (vLLM's meaning) leaves the KV cache what the weights, the adapter
bank, the activations and the fine-tuning reserve do not take, or is refused with the numbers and flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coserve.contract.kv_capacity import KvCacheTooSmall
from coserve.contract.training_settings import LoRASettings, OptimizerSettings
from coserve.forward.kv_cache import KVCache
from coserve.forward.lora import LoRABank
from coserve.model.config import ModelConfig
from coserve.model.memory import LOSS_VOCAB_CHUNK, WorkingSizes, adapter_bytes, cache_tokens, kv_bytes_per_token
from coserve.torch_engine.memory_budget import GIB, DeviceMemory, MemorySplit, bank_slot_bytes
from coserve.trainer.loss import DEFAULT_VOCAB_CHUNK
from coserve.trainer.setup import build_trainable
from coserve.vllm.memory_share import vllm_utilization

SIZES = WorkingSizes(max_batch_tokens=2048, max_num_seqs=64, max_model_len=8192, window_tokens=256,
                     max_lora_rank=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kv_token_is_what_the_paged_cache_allocates(model_dirs: dict[str, Path], dtype: torch.dtype) -> None:
    for folder in model_dirs.values():
        cfg = ModelConfig.from_pretrained(folder)
        per_block = KVCache.bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
        assert kv_bytes_per_token(cfg, dtype.itemsize) * 16 == per_block
        assert cache_tokens(cfg, dtype.itemsize, 10 * per_block + 1) == 160


def test_adapters_are_what_the_trainer_and_the_bank_hold(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The trainer's adapter (PEFT's A and B per projection, float32) and one bank slot (the fused
    layout, in the engine's dtype), counted from their tensors."""
    assert LOSS_VOCAB_CHUNK == DEFAULT_VOCAB_CHUNK
    for arch, folder in model_dirs.items():
        cfg = ModelConfig.from_pretrained(folder)
        lora, _ = build_trainable(cfg, "cpu", LoRASettings(r=4), OptimizerSettings(), seed=0)
        assert adapter_bytes(cfg, 4, 4) == sum(t.numel() * 4 for t in lora.parameters()), arch
        lora.save_pretrained(tmp_path / arch)
        bank = LoRABank(cfg, 1, 8, torch.bfloat16, torch.device("cpu"))
        bank.load(0, 1, tmp_path / arch)
        held = sum(t.numel() * t.element_size() for layer in bank.slots[0].layers
                   for pair in layer for t in (pair.a_t, pair.b_t))
        assert bank_slot_bytes(cfg, 4, 2) == held, arch


def _split(weights_gib: float = 16.0) -> MemorySplit:
    return MemorySplit(weights=int(weights_gib * GIB), adapter_bank=GIB, activations=GIB, trainer=2 * GIB)


def test_the_kv_cache_gets_what_the_fraction_leaves() -> None:
    """vLLM's meaning: 0.9 of an 80 GiB device is 72 GiB for everything; 16 GiB of weights, 1 GiB of
    bank, 1 GiB of activations and 2 GiB of fine-tuning reserve leave the cache 52 GiB."""
    device = DeviceMemory("cuda:0", total=80 * GIB, free=64 * GIB)  # the weights are loaded already
    assert _split().kv_cache_bytes(device, 0.9) == pytest.approx(52 * GIB, abs=1)
    assert _split().kv_cache_bytes(device, 0.5) == pytest.approx(20 * GIB, abs=1)


def test_a_fraction_that_leaves_nothing_or_more_than_is_free_is_refused() -> None:
    device = DeviceMemory("cuda:0", total=80 * GIB, free=64 * GIB)
    with pytest.raises(KvCacheTooSmall, match=r"^--gpu-memory-utilization 0.2 gives this engine 16.00 GiB of "
                                              r"cuda:0's 80.00 GiB, and weights 16.00 GiB, adapter bank 1.00 GiB, "
                                              r"activations 1.00 GiB, fine-tuning reserve 2.00 GiB leave nothing "
                                              r"for the KV cache: raise --gpu-memory-utilization"):
        _split().kv_cache_bytes(device, 0.2)
    crowded = DeviceMemory("cuda:0", total=80 * GIB, free=30 * GIB)  # another process holds 34 GiB
    with pytest.raises(KvCacheTooSmall, match=r"leaves the KV cache 52.00 GiB, and cuda:0 has 30.00 GiB free .*"
                                              r"lower --gpu-memory-utilization, or give --kv-cache-memory-gb"):
        _split().kv_cache_bytes(crowded, 0.9)
    assert _split().kv_cache_bytes(crowded, 0.5) == pytest.approx(20 * GIB, abs=1)  # 20 + 4 <= 30 free


def test_the_split_counts_the_bank_at_its_largest_rank_and_grows_with_the_context(llama_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(llama_dir)
    split = MemorySplit.of(cfg, 4, weights=GIB, adapter_slots=3, sizes=SIZES)
    assert split.adapter_bank == 3 * bank_slot_bytes(cfg, 64, 4)
    longer = MemorySplit.of(cfg, 4, weights=GIB, adapter_slots=3,
                            sizes=WorkingSizes(2048, 64, 2 * 8192, 256, 64))
    # A training sequence keeps every layer's input, the gradient buffer and one layer's K/V gradient.
    per_position = ((cfg.num_layers + 1) * cfg.hidden_size + 2 * cfg.kv_size) * 4
    assert longer.trainer - split.trainer == 8192 * per_position
    assert (longer.weights, longer.adapter_bank, longer.activations) == (split.weights, split.adapter_bank,
                                                                         split.activations)


def test_vllm_gets_the_fraction_less_the_trainers_share() -> None:
    """vLLM counts its weights, LoRA bank and profiled forward inside the fraction it is given; the trainer
    lives beside it in the same process, so its reserve comes off first."""
    assert vllm_utilization(0.9, 8 * GIB, 80 * GIB) == pytest.approx(0.8)
    with pytest.raises(KvCacheTooSmall, match=r"^--gpu-memory-utilization 0.05 gives the engine 4.00 GiB, and the "
                                              r"fine-tuning reserve alone takes 8.00 GiB"):
        vllm_utilization(0.05, 8 * GIB, 80 * GIB)
