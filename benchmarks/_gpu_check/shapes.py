"""Model shapes and workload sizes of the GPU check: real sizes on a GPU, tiny ones with ``--quick``.

The shapes are those of public checkpoints (their ``config.json``), with random weights drawn on the
machine (``models``): SmolLM2-135M, Llama-3.2-1B (Llama 3 RoPE scaling, tied embeddings), Qwen2.5-0.5B
(q/k/v bias, 7:1 grouped-query heads) and Mistral-7B-v0.3's layer shapes (head_dim 128, untied) with 2
of its 32 layers, so that its fp32 copy stays small. ``--quick`` keeps each family's traits (bias,
head ratios, tying, RoPE scaling) at widths of a few hundred, two layers and a 1024-token vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@dataclass(frozen=True, slots=True)
class Shape:
    """One model: its family and the config fields `create_tiny_model` overrides."""

    arch: str
    fields: dict[str, Any]
    origin: str  # what it is shaped like, for the report


REAL: dict[str, Shape] = {
    "smollm2-135m": Shape("llama", dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_theta=100000.0, rope_scaling=None), "SmolLM2-135M"),
    "llama-1b": Shape("llama", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={**LLAMA3_SCALING, "original_max_position_embeddings": 8192}),
        "Llama-3.2-1B"),
    "qwen-0.5b": Shape("qwen2", dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_theta=1000000.0), "Qwen2.5-0.5B (q/k/v bias)"),
    "mistral-7b-2l": Shape("mistral", dict(
        hidden_size=4096, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=32768, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_theta=1000000.0), "Mistral-7B-v0.3 layers (2 of 32)"),
}

QUICK: dict[str, Shape] = {
    "smollm2-135m": Shape("llama", dict(
        hidden_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
        intermediate_size=192, vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=True,
        rope_theta=100000.0, rope_scaling=None), "SmolLM2-135M, tiny"),
    "llama-1b": Shape("llama", dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        intermediate_size=256, vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling=LLAMA3_SCALING), "Llama-3.2-1B, tiny"),
    "qwen-0.5b": Shape("qwen2", dict(
        hidden_size=224, num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=1,
        intermediate_size=256, vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=True,
        rope_theta=1000000.0), "Qwen2.5-0.5B (q/k/v bias), tiny"),
    "mistral-7b-2l": Shape("mistral", dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        intermediate_size=256, vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_theta=1000000.0), "Mistral-7B-v0.3 layers, tiny"),
}

PARITY_MODELS = ("smollm2-135m", "llama-1b", "qwen-0.5b", "mistral-7b-2l")
MAIN_MODEL = "llama-1b"  # throughput, trainer and co-serving run on it


@dataclass(frozen=True, slots=True)
class Workload:
    """Every size a part uses."""

    lora_rank: int
    lora_alpha: float
    lora_b_std: float  # random B (PEFT's is zero: a no-op adapter would prove nothing)
    max_model_len: int
    # parity: `parity_prompts` prompts, each once through the base model and once through the adapter
    parity_prompts: int
    prompt_len: tuple[int, int]
    parity_tokens: int
    parity_kv_blocks: int
    # gradient: one sequence, trained in one window and in windows of `grad_window`
    grad_models: tuple[str, ...]
    grad_len: int
    grad_window: int
    # engine throughput
    batches: tuple[int, ...]
    throughput_prompt_len: tuple[int, int]
    throughput_tokens: int
    throughput_kv_blocks: int
    throughput_batch_tokens: int
    # trainer memory and speed: sequences of `train_len` tokens (the second half trained), windows
    train_len: int
    train_window: int
    train_steps: int  # timed steps per arm (after one warm-up step)
    # co-serving (`coserve bench co-serving --quick`'s code, these settings)
    coserving_rates: str
    coserving_policies: str
    coserving_window_s: float
    coserving_finetune_tokens: str
    coserving_dtype: str  # bf16 on a GPU; float32 on the CPU, whose bf16 matmuls are slow


GPU = Workload(
    lora_rank=16, lora_alpha=32.0, lora_b_std=0.02, max_model_len=4096,
    parity_prompts=4, prompt_len=(96, 160), parity_tokens=32, parity_kv_blocks=512,
    grad_models=("llama-1b", "qwen-0.5b"), grad_len=1024, grad_window=256,
    batches=(32, 128), throughput_prompt_len=(64, 192), throughput_tokens=128, throughput_kv_blocks=4096,
    throughput_batch_tokens=8192,
    train_len=2048, train_window=512, train_steps=3,
    coserving_rates="2,8", coserving_policies="coserve,temporal-n16", coserving_window_s=10.0,
    coserving_finetune_tokens="256,1024", coserving_dtype="bfloat16")

QUICK_SIZES = Workload(
    lora_rank=8, lora_alpha=16.0, lora_b_std=0.05, max_model_len=512,
    parity_prompts=2, prompt_len=(8, 24), parity_tokens=8, parity_kv_blocks=64,
    grad_models=("llama-1b", "qwen-0.5b"), grad_len=48, grad_window=16,
    batches=(4, 8), throughput_prompt_len=(8, 24), throughput_tokens=8, throughput_kv_blocks=128,
    throughput_batch_tokens=512,
    train_len=64, train_window=16, train_steps=1,
    coserving_rates="2", coserving_policies="coserve,temporal-n16", coserving_window_s=1.0,
    coserving_finetune_tokens="32,64", coserving_dtype="float32")


def shapes(quick: bool) -> dict[str, Shape]:
    return QUICK if quick else REAL


def workload(quick: bool) -> Workload:
    return QUICK_SIZES if quick else GPU
