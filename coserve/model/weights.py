"""Base-model weights: read HF safetensors shards into coserve's fused, frozen layout.

q/k/v are fused into one projection and gate/up into another, so a layer runs two big matmuls
instead of five; LoRA deltas are added to the matching column slices of the fused outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from coserve.model.config import ModelConfig, UnsupportedModelError


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer. Linear weights are [out_features, in_features] like torch.nn.Linear."""

    input_norm: torch.Tensor
    qkv_w: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        files = [f for f in files if not f.name.startswith("adapter_")]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise UnsupportedModelError(
            f"missing weight files in {model_dir}: {missing or 'no *.safetensors found'}")
    return files


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor name a checkpoint of `cfg` may hold (optional biases and norms included)."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (h,),
        "self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        "mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,),
    }
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h),
              "model.norm.weight": (h,)}
    for layer in range(cfg.num_layers):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes


class _TensorSource:
    """Name -> tensor over several shards, loading each tensor only when asked.

    Each shard is opened (memory-mapped) once: a tensor whose dtype and device need no conversion is a
    view of its shard's mapping, so a shard opened per tensor would map the whole file once per tensor
    (SmolLM2: 272 mappings of 538 MB, 140 GB of address space, which a memory cap refuses).
    """

    def __init__(self, model_dir: Path) -> None:
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._open: dict[Path, Any] = {}
        for f in _weight_files(model_dir):
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    self._where[name] = f
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())
        self._model_dir = model_dir

    def has(self, name: str) -> bool:
        return name in self._where

    def check_shapes(self, cfg: ModelConfig) -> None:
        """Refuse, before loading anything, a tensor whose shape is not the one config.json implies."""
        for name, shape in expected_shapes(cfg).items():
            found = self._shapes.get(name)
            if found is not None and found != shape:
                raise UnsupportedModelError(
                    f"weight {name!r} in {self._where[name]} has shape {list(found)}, but config.json "
                    f"implies {list(shape)}: the weights do not match the config")

    def get(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if name not in self._where:
            raise UnsupportedModelError(f"weight {name!r} not found in {self._model_dir}")
        shard = self._where[name]
        if shard not in self._open:
            self._open[shard] = safe_open(str(shard), framework="pt")
        tensor: torch.Tensor = self._open[shard].get_tensor(name)  # framework="pt": a torch tensor
        return tensor.to(device=device, dtype=dtype).contiguous()

    def close(self) -> None:
        """Let go of the shards (tensors that view a mapping keep it)."""
        self._open.clear()

    def maybe(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return self.get(name, dtype, device) if self.has(name) else None


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise UnsupportedModelError("some but not all fused projections have a bias")
    return torch.cat(parts, dim=0).contiguous()  # type: ignore[arg-type]


def _layer(src: _TensorSource, cfg: ModelConfig, i: int, dtype: torch.dtype,
           device: torch.device) -> LayerWeights:
    p = f"model.layers.{i}."

    def get(name: str) -> torch.Tensor:
        return src.get(p + name, dtype, device)

    def opt(name: str) -> torch.Tensor | None:
        return src.maybe(p + name, dtype, device)

    attn, mlp = "self_attn.", "mlp."
    return LayerWeights(
        input_norm=get("input_layernorm.weight"),
        qkv_w=torch.cat([get(attn + f"{m}.weight") for m in ("q_proj", "k_proj", "v_proj")]),
        qkv_b=_cat([opt(attn + f"{m}.bias") for m in ("q_proj", "k_proj", "v_proj")]),
        q_norm=get(attn + "q_norm.weight") if cfg.qk_norm else None,
        k_norm=get(attn + "k_norm.weight") if cfg.qk_norm else None,
        o_w=get(attn + "o_proj.weight"),
        o_b=opt(attn + "o_proj.bias"),
        post_norm=get("post_attention_layernorm.weight"),
        gate_up_w=torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]),
        gate_up_b=_cat([opt(mlp + "gate_proj.bias"), opt(mlp + "up_proj.bias")]),
        down_w=get(mlp + "down_proj.weight"),
        down_b=opt(mlp + "down_proj.bias"),
    )


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> ModelWeights:
    """Load every base weight of `model_dir` in `dtype` on `device`.

    Raises:
        UnsupportedModelError: missing shards or tensors, or a tensor of the wrong shape.
    """
    src = _TensorSource(Path(model_dir))
    src.check_shapes(cfg)
    try:
        embed = src.get("model.embed_tokens.weight", dtype, device)
        if cfg.tie_word_embeddings or not src.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = src.get("lm_head.weight", dtype, device)
        layers = [_layer(src, cfg, i, dtype, device) for i in range(cfg.num_layers)]
        return ModelWeights(embed=embed, layers=layers,
                            final_norm=src.get("model.norm.weight", dtype, device), lm_head=lm_head)
    finally:
        src.close()


def check_weights(model_dir: str | Path, cfg: ModelConfig) -> None:
    """Check that `model_dir` holds every weight `cfg` needs, in the right shapes, without loading them.

    Raises:
        UnsupportedModelError: missing shards or tensors, or a tensor of the wrong shape.
    """
    src = _TensorSource(Path(model_dir))
    src.check_shapes(cfg)
    # Like load_weights: without lm_head.weight the embedding serves as the output layer.
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    required += [name for name in expected_shapes(cfg)
                 if name.startswith("model.layers.") and _is_required(name, cfg)]
    missing = [name for name in required if not src.has(name)]
    if missing:
        raise UnsupportedModelError(f"{len(missing)} weight(s) missing in {model_dir}, e.g. {missing[0]!r}")


def _is_required(name: str, cfg: ModelConfig) -> bool:
    if name.endswith(".bias"):
        return False  # biases are optional here; load_weights checks they come all or none
    return cfg.qk_norm or not name.endswith(("q_norm.weight", "k_norm.weight"))
