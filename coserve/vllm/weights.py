"""coserve's `ModelWeights` as zero-copy views of the tensors of a model vLLM loaded.

vLLM stacks `qkv_proj` and `gate_up_proj` as coserve's own fused layout does, and wraps each linear layer
in a LoRA layer whose `base_layer` holds the weight; the views share vLLM's storage, so the trainer
trains against the very weights vLLM serves from.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, cast

import torch

from coserve.model.config import ModelConfig, UnsupportedModelError
from coserve.model.weights import LayerWeights, ModelWeights


class _Weighted(Protocol):
    """A linear, embedding or norm layer (vLLM's LoRA wrapper has its `base_layer`'s `weight` too)."""

    @property
    def weight(self) -> torch.Tensor: ...


class _Attention(Protocol):
    qkv_proj: _Weighted
    o_proj: _Weighted


class _Mlp(Protocol):
    gate_up_proj: _Weighted
    down_proj: _Weighted


class _DecoderLayer(Protocol):
    self_attn: _Attention
    mlp: _Mlp
    input_layernorm: _Weighted
    post_attention_layernorm: _Weighted


class _Decoder(Protocol):
    layers: Iterable[_DecoderLayer]
    embed_tokens: _Weighted
    norm: _Weighted


class _CausalLM(Protocol):
    """vLLM's model module as coserve reads it; `lm_head` is absent where the embedding is tied."""

    model: _Decoder
    lm_head: _Weighted


def model_weights(model: torch.nn.Module, cfg: ModelConfig) -> ModelWeights:
    """coserve's `ModelWeights` as views of vLLM's own tensors (no copy: the same storage).

    Args:
        model: vLLM's model module (`model_runner.model`).
        cfg: the model's coserve config (the shapes expected).

    Raises:
        UnsupportedModelError: vLLM's module tree or shapes are not the layout coserve expects.
    """
    lm = cast(_CausalLM, model)  # the layout coserve expects: an attribute that is not there raises below
    try:
        decoder = lm.model
        layers = [_layer(layer, cfg) for layer in decoder.layers]
        embed = _weight(decoder.embed_tokens)[: cfg.vocab_size]
        head = _weight(lm.lm_head)[: cfg.vocab_size] if hasattr(lm, "lm_head") else embed
        final_norm = decoder.norm.weight
    except AttributeError as error:
        raise UnsupportedModelError(f"vLLM's {type(model).__name__} is not laid out as coserve's "
                                    f"trainer expects: {error}") from None
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=head)


def _weight(module: _Weighted) -> torch.Tensor:
    """A linear or embedding layer's weight (the base layer's when vLLM wrapped it for LoRA)."""
    return getattr(module, "base_layer", module).weight


def _bias(module: _Weighted) -> torch.Tensor | None:
    return getattr(getattr(module, "base_layer", module), "bias", None)


def _layer(layer: _DecoderLayer, cfg: ModelConfig) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    weights = LayerWeights(
        input_norm=layer.input_layernorm.weight, qkv_w=_weight(attn.qkv_proj), qkv_b=_bias(attn.qkv_proj),
        q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
        o_w=_weight(attn.o_proj), o_b=_bias(attn.o_proj), post_norm=layer.post_attention_layernorm.weight,
        gate_up_w=_weight(mlp.gate_up_proj), gate_up_b=_bias(mlp.gate_up_proj),
        down_w=_weight(mlp.down_proj), down_b=_bias(mlp.down_proj))
    h = cfg.hidden_size
    expected = {"qkv_w": (cfg.q_size + 2 * cfg.kv_size, h), "o_w": (h, cfg.q_size),
                "gate_up_w": (2 * cfg.intermediate_size, h), "down_w": (h, cfg.intermediate_size)}
    for name, shape in expected.items():
        found = tuple(getattr(weights, name).shape)
        if found != shape:
            raise UnsupportedModelError(f"vLLM's {name} has shape {found}, coserve expects {shape} "
                                        f"(the weight was not kept, or another layout)")
    return weights
