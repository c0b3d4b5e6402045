"""Model configuration read from an HF-format folder's `config.json`.

Only the families whose forward coserve implements are accepted; anything else is refused with a
message naming what is supported. Rope settings are read in both spellings transformers has used:
`rope_scaling` + `rope_theta` (transformers 4.x) and `rope_parameters` (transformers 5.x).

Torch-free (torch is imported by `resolve_dtype` only): the gateway and the scheduler read the model's
shapes, vocabulary size and EOS ids without loading torch.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Architecture(enum.Enum):
    """Model families with a native coserve forward."""

    LLAMA = "LlamaForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN3 = "Qwen3ForCausalLM"
    MISTRAL = "MistralForCausalLM"


SUPPORTED_ARCHITECTURES = ", ".join(a.value for a in Architecture)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Accepted dtype spellings -> torch's name of the dtype.
DTYPES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


class UnsupportedModelError(ValueError):
    """The folder holds a model coserve cannot run (architecture, rope type, missing files)."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding settings: base, and the scaling rule applied to the inverse frequencies."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shapes and switches of a decoder-only transformer of one of the supported families."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 with attention_bias)
    o_bias: bool  # bias on o_proj (Llama/Qwen3 attention_bias; never Qwen2)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection, by PEFT module name."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read and validate `config.json` in `model_dir`.

        Raises:
            UnsupportedModelError: missing config, unknown architecture or rope type, bad shapes.
        """
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"no config.json in {model_dir}: not an HF-format model folder")
        raw = json.loads(path.read_text())
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = _architecture(raw)
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw),
            max_position_embeddings=_max_positions(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch is Architecture.QWEN2 or attention_bias,
            o_bias=arch is not Architecture.QWEN2 and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch is Architecture.QWEN3,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


# config.json `model_type` -> family, for configs written without `architectures` (some converters
# and hand-written configs omit it; transformers then picks the *ForCausalLM class from model_type).
MODEL_TYPES: dict[str, Architecture] = {
    "llama": Architecture.LLAMA,
    "qwen2": Architecture.QWEN2,
    "qwen3": Architecture.QWEN3,
    "mistral": Architecture.MISTRAL,
}


def _architecture(raw: dict[str, Any]) -> Architecture:
    names = raw.get("architectures") or []
    for name in names:
        for arch in Architecture:
            if arch.value == name:
                return arch
    # Only a config with no `architectures` falls back: a listed class (say a sequence classifier)
    # is not a causal LM even when its model_type is one coserve runs.
    if not names and raw.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[raw["model_type"]]
    raise UnsupportedModelError(
        f"unsupported architecture {names or raw.get('model_type')!r}; coserve supports "
        f"{SUPPORTED_ARCHITECTURES}")


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r}; coserve supports {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))),
    )


def _max_positions(raw: dict[str, Any]) -> int:
    limit = int(raw.get("max_position_embeddings", 2048))
    # Sliding-window attention is not implemented; cap the context at the window so results stay exact.
    window = raw.get("sliding_window")
    use_window = raw.get("use_sliding_window", raw.get("model_type") == "mistral")
    if window and use_window:
        limit = min(limit, int(window))
    return limit


def dtype_name(dtype: str, config: ModelConfig) -> str:
    """The canonical name ("float32", "bfloat16", "float16") of a user dtype: the one meaning of `--dtype`.

    "auto" is the model config's `torch_dtype` (or `dtype`; float32 when it names none), on every device
    and for every engine: a float32 model stays float32 on the CPU (vLLM's own "auto" would make it
    bfloat16 there, so coserve resolves it and hands vLLM the explicit name). An explicit dtype is kept.

    Raises:
        ValueError: an unsupported dtype.
    """
    if dtype == "auto":
        dtype = config.torch_dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def resolve_dtype(dtype: Any, config: ModelConfig) -> Any:
    """Map a user dtype ("auto", "float32", "bfloat16", ...) or a torch dtype to a torch dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtype_name(dtype, config))
