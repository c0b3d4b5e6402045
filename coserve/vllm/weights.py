"""coserve's `ModelWeights` as zero-copy views of the tensors of a model vLLM loaded.

vLLM stacks `qkv_proj` and `gate_up_proj` as coserve's own fused layout does, and wraps each linear layer
in a LoRA layer whose `base_layer` holds the weight; the views share vLLM's storage, so the trainer
trains against the very weights vLLM serves from.
"""

from __future__ import annotations

import torch

from coserve.model.config import ModelConfig, UnsupportedModelError
from coserve.model.weights import LayerWeights, ModelWeights


def model_weights(model: torch.nn.Module, cfg: ModelConfig) -> ModelWeights:
    """coserve's `ModelWeights` as views of vLLM's own tensors (no copy: the same storage).

    Args:
        model: vLLM's model module (`model_runner.model`).
        cfg: the model's coserve config (the shapes expected).

    Raises:
        UnsupportedModelError: vLLM's module tree or shapes are not the layout coserve expects.
    """
    try:
        decoder = model.model
        layers = [_layer(layer, cfg) for layer in decoder.layers]
        embed = _weight(decoder.embed_tokens)[: cfg.vocab_size]
        head = _weight(model.lm_head)[: cfg.vocab_size] if hasattr(model, "lm_head") else embed
        final_norm = decoder.norm.weight
    except AttributeError as error:
        raise UnsupportedModelError(f"vLLM's {type(model).__name__} is not laid out as coserve's "
                                    f"trainer expects: {error}") from None
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=head)


def _weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear or embedding layer's weight (the base layer's when vLLM wrapped it for LoRA)."""
    return getattr(module, "base_layer", module).weight


def _bias(module: torch.nn.Module) -> torch.Tensor | None:
    return getattr(getattr(module, "base_layer", module), "bias", None)


def _layer(layer: torch.nn.Module, cfg: ModelConfig) -> LayerWeights:
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
