"""What a model's pieces take in memory, in bytes, from its config alone (torch-free): one token of KV
cache, one LoRA adapter, and the working memory of inference and of the trainer beside the weights.

An engine's memory is split between the weights, the KV cache, the adapter bank (`--adapter-slots`
adapters of up to `max_lora_rank`) and working memory: the forward's activations over one batch, and the
trainer's reserve (a job's trainable adapter with its AdamW state, one training sequence's kept layer
inputs, one forward window's working set). `--gpu-memory-utilization` caps the sum on CUDA
(`coserve.torch_engine.memory_budget`, `coserve.vllm.memory_share`); docs/serving.md#memory says how the
KV cache gets what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from coserve.model.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FLOAT32_BYTES = 4
ADAMW_COPIES = 4  # a trainable LoRA in float32: weights, gradient, AdamW's two moments
LOSS_VOCAB_CHUNK = 4096  # the trainer's cross-entropy works on this many vocabulary columns at a time


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """K and V of one token position, every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def cache_tokens(cfg: ModelConfig, dtype_bytes: int, cache_bytes: float) -> int:
    """Token positions a KV cache of `cache_bytes` holds at most (before rounding to whole blocks)."""
    return int(cache_bytes // kv_bytes_per_token(cfg, dtype_bytes))


def adapter_bytes(cfg: ModelConfig, rank: int, dtype_bytes: int) -> int:
    """One LoRA adapter of `rank` on every targetable projection of every layer, as PEFT keeps it (A and B
    per projection: the trainer's; the engine's bank fuses them, `torch_engine.memory_budget`)."""
    per_layer = sum(rank * (fan_in + fan_out) for fan_in, fan_out in cfg.linear_shapes().values())
    return cfg.num_layers * per_layer * dtype_bytes


@dataclass(frozen=True, slots=True)
class WorkingSizes:
    """The sizes that decide activations: the engine's batch and context, the trainer's window."""

    max_batch_tokens: int
    max_num_seqs: int
    max_model_len: int
    window_tokens: int
    max_lora_rank: int


def forward_activation_bytes(cfg: ModelConfig, dtype_bytes: int, sizes: WorkingSizes) -> int:
    """One inference forward over `max_batch_tokens` tokens: a layer's working set (hidden states, q/k/v,
    the MLP's gate and up) and the sampled rows' float32 logits."""
    per_token = 4 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size
    logits = min(sizes.max_num_seqs, sizes.max_batch_tokens) * cfg.vocab_size * FLOAT32_BYTES
    return sizes.max_batch_tokens * per_token * dtype_bytes + logits


def trainer_reserve_bytes(cfg: ModelConfig, dtype_bytes: int, sizes: WorkingSizes) -> int:
    """What one fine-tuning job needs beside the weights and the KV cache: its adapter at `max_lora_rank`
    with gradient and AdamW moments (float32), one `max_model_len` training sequence's kept state (every
    layer's input, the gradient buffer, one layer's K/V gradient) and one forward window's working set
    (forward and recomputed backward) with its loss chunk."""
    adapter = adapter_bytes(cfg, sizes.max_lora_rank, FLOAT32_BYTES) * ADAMW_COPIES
    per_position = (cfg.num_layers + 1) * cfg.hidden_size + 2 * cfg.kv_size
    sequence = sizes.max_model_len * per_position * dtype_bytes
    window_per_token = 4 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size
    loss = sizes.window_tokens * min(cfg.vocab_size, LOSS_VOCAB_CHUNK) * FLOAT32_BYTES * 2
    return adapter + sequence + sizes.window_tokens * window_per_token * dtype_bytes * 2 + loss
