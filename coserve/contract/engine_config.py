"""`EngineConfig`: how to build an engine, of either backend (torch-free, so that whoever starts an
engine actor need not load torch: the engine's own process builds the engine from it)."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.contract import defaults
from coserve.contract.engine import EngineKind


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build an engine. Sizes are the user's; measured facts go into `RuntimeLayout`."""

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = defaults.BLOCK_SIZE
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # default: a fixed size on the CPU, gpu_memory_utilization on CUDA
    # CUDA, vLLM's meaning: the fraction of the GPU's total memory the engine may use, its weights, adapter
    # bank, activations and fine-tuning reserve included; the KV cache gets the rest (ignored on the CPU).
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_loras: int = defaults.ADAPTER_SLOTS  # adapter slots in the bank
    max_lora_rank: int = defaults.MAX_LORA_RANK
    seed: int = 0
    native_kernels: bool = True  # the C paged-decode kernel on CPU/fp32 (falls back to torch without gcc)
    engine: EngineKind = EngineKind.TORCH  # which backend builds from this (coserve.backends.registry)
    # vLLM's own scheduler budgets (at least what coserve's scheduler plans); coserve's engine needs none.
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_batch_tokens: int = defaults.MAX_BATCH_TOKENS
