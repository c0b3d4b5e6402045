"""Trainable LoRA weights: fp32 master copies in PEFT's layout, PEFT init, PEFT save/load.

Each (layer, module) pair has `A` [r, in_features] and `B` [out_features, r], exactly the shapes of
PEFT's `lora_A.weight` / `lora_B.weight`, so gradients compare one to one with `peft` and the saved
folder is a plain PEFT adapter. The base model may run in bf16; the master weights stay fp32 and are
cast per use, so the optimizer (a later step) updates fp32 values.

The engine applies LoRA through fused projections (`coserve.forward.lora`: stacked A, block-diagonal
B with the scale folded in). `fused_layer` builds that fused form *differentiably* from the master
weights, so the trainer's recompute runs the engine's own layer code and gradients flow back to A and B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from coserve.contract.training_settings import TARGET_MODULES, LoRASettings
from coserve.forward.lora import AdapterLayer, AdapterWeights, contiguous_layer, fuse_layer
from coserve.model.config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"\.weight$")


def peft_key(layer: int, module: str, which: str) -> str:
    """PEFT's saved name of a LoRA weight.

    E.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
    """
    parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight"


def to_peft_dict(settings: LoRASettings, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The `adapter_config.json` content, as PEFT writes it for `settings`."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": settings.r, "lora_alpha": settings.lora_alpha, "lora_dropout": settings.lora_dropout,
        "target_modules": list(settings.target_modules), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": settings.use_rslora, "use_dora": False, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def from_peft_dict(raw: dict[str, Any]) -> LoRASettings:
    """Read the settings back; refuses PEFT features the trainer does not implement."""
    unsupported = [k for k in ("use_dora", "modules_to_save", "rank_pattern",
                               "alpha_pattern", "layers_to_transform") if raw.get(k)]
    if raw.get("peft_type", "LORA") != "LORA" or raw.get("bias", "none") != "none":
        unsupported.append("peft_type/bias")
    if unsupported:
        raise ValueError(f"adapter config uses features the trainer does not support: {unsupported}")
    modules = raw["target_modules"]
    modules = [modules] if isinstance(modules, str) else modules
    return LoRASettings(r=int(raw["r"]), lora_alpha=float(raw.get("lora_alpha", raw["r"])),
                        lora_dropout=float(raw.get("lora_dropout", 0.0)), target_modules=tuple(modules),
                        use_rslora=bool(raw.get("use_rslora", False)))


@dataclass(slots=True)
class TrainableLoRA:
    """fp32 master LoRA weights of every (layer, module), leaves with `requires_grad`.

    `a[(i, m)]` is PEFT's `lora_A.weight` [r, in], `b[(i, m)]` its `lora_B.weight` [out, r].
    """

    config: LoRASettings
    model_config: ModelConfig
    a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def init(cls, model_config: ModelConfig, config: LoRASettings, seed: int,
             device: torch.device | str = "cpu") -> TrainableLoRA:
        """PEFT's default init from `seed`: A Kaiming-uniform (a=sqrt(5)), B zeros.

        Kaiming-uniform with a=sqrt(5) is U(-1/sqrt(in), 1/sqrt(in)), as `nn.Linear` and PEFT use.
        Draws go layer by layer in the engine's module order, so a seed always gives the same A.
        """
        g = torch.Generator().manual_seed(seed)
        shapes = model_config.linear_shapes()
        lora = cls(config=config, model_config=model_config)
        for i in range(model_config.num_layers):
            for m in config.target_modules:
                d_in, d_out = shapes[m]
                a = torch.empty(config.r, d_in)
                torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
                lora.a[(i, m)] = a.to(device).requires_grad_()
                lora.b[(i, m)] = torch.zeros(d_out, config.r, device=device).requires_grad_()
        return lora

    def parameters(self) -> list[torch.Tensor]:
        """All master tensors, A then B of each (layer, module) in order (for an optimizer)."""
        return [t for key in self.a for t in (self.a[key], self.b[key])]

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """PEFT key -> master tensor."""
        out = {}
        for (i, m), a in self.a.items():
            out[peft_key(i, m, "A")] = a
            out[peft_key(i, m, "B")] = self.b[(i, m)]
        return out

    def zero_grad(self) -> None:
        for t in self.parameters():
            t.grad = None

    def fused_layer(self, layer: int, dtype: torch.dtype) -> AdapterLayer:
        """The engine's fused LoRA pairs of `layer`, built from the master weights with autograd.

        Under `torch.no_grad` this is a plain copy for inference (the bank's live adapter); with grad
        enabled, `x @ a_t @ b_t` back-propagates into `a` and `b` (cast and block layout included).
        """
        modules = [m for m in TARGET_MODULES if (layer, m) in self.a]
        return fuse_layer({m: self.a[(layer, m)] for m in modules},
                          {m: self.b[(layer, m)] for m in modules},
                          {m: self.config.scale for m in modules},
                          self.model_config.linear_shapes(), dtype)

    @torch.no_grad()
    def adapter_weights(self, adapter_id: int, dtype: torch.dtype) -> AdapterWeights:
        """A detached snapshot in the bank's fused layout, for `LoRABank.install`."""
        layers = [contiguous_layer(self.fused_layer(i, dtype))
                  for i in range(self.model_config.num_layers)]
        return AdapterWeights(adapter_id=adapter_id, rank=self.config.r,
                              target_modules=self.config.target_modules,
                              layers=layers)

    def save_pretrained(self, path: str | Path, base_model_name_or_path: str | None = None) -> Path:
        """Write a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = to_peft_dict(self.config, base_model_name_or_path)
        (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tensors = {k: t.detach().to("cpu", torch.float32).contiguous()
                   for k, t in self.named_parameters().items()}
        save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, model_config: ModelConfig,
                        device: torch.device | str = "cpu") -> TrainableLoRA:
        """Read a PEFT adapter folder back as trainable fp32 weights.

        Raises:
            ValueError: unsupported settings, unknown or missing tensors, wrong shapes.
        """
        path = Path(path)
        config = from_peft_dict(json.loads((path / ADAPTER_CONFIG).read_text()))
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
        lora = cls(config=config, model_config=model_config)
        shapes = model_config.linear_shapes()
        for name, tensor in tensors.items():
            match = _KEY.match(name.replace(".default.weight", ".weight"))
            if match is None or match[3] not in config.target_modules:
                raise ValueError(f"adapter {path}: unexpected tensor {name!r}")
            i, m, which = int(match[1]), match[3], match[4]
            d_in, d_out = shapes[m]
            expected = (config.r, d_in) if which == "A" else (d_out, config.r)
            if i >= model_config.num_layers or tuple(tensor.shape) != expected:
                raise ValueError(f"adapter {path}: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {expected} in a {model_config.num_layers}-layer model")
            target = lora.a if which == "A" else lora.b
            target[(i, m)] = tensor.to(device, torch.float32).requires_grad_()
        expected_keys = {(i, m) for i in range(model_config.num_layers) for m in config.target_modules}
        if set(lora.a) != expected_keys or set(lora.b) != expected_keys:
            raise ValueError(f"adapter {path}: missing LoRA tensors for "
                             f"{sorted(expected_keys - (set(lora.a) & set(lora.b)))[:4]}")
        # Dict order follows the file; re-key in canonical order so parameters() is deterministic.
        lora.a = {k: lora.a[k] for k in sorted(lora.a, key=_canonical)}
        lora.b = {k: lora.b[k] for k in sorted(lora.b, key=_canonical)}
        return lora


def _canonical(key: tuple[int, str]) -> tuple[int, int]:
    return key[0], TARGET_MODULES.index(key[1])
