"""The random models and adapters the parts run on, built on the machine once per run.

Weights are drawn by `coserve.model.tiny_model.create_tiny_model` (its peaked init: logits far apart,
so two correct implementations agree on greedy tokens) on the check's device, and written as float32
safetensors that coserve and transformers both load. If drawing on the device fails, the model is drawn
on the CPU instead and the report says so. Adapters are PEFT folders written by coserve's
`TrainableLoRA` (PEFT's init from a seed, then a random B, so the adapter changes the outputs).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

import torch

from _gpu_check.shapes import Shape, Workload

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelStore:
    """Model folders under `root`, made on first use; `notes` records how each was made and how long it took."""

    def __init__(self, root: Path, device: str, shapes: dict[str, Shape], sizes: Workload) -> None:
        self.root, self.device, self.shapes, self.sizes = root, device, shapes, sizes
        self.notes: dict[str, dict[str, Any]] = {}

    def model(self, name: str) -> Path:
        """The folder of model `name` (a key of `shapes`)."""
        path = self.root / name
        if (path / "config.json").exists():
            return path
        from coserve.model.tiny_model import count_parameters, create_tiny_model

        shape = self.shapes[name]
        start, drawn_on, fallback = time.perf_counter(), self.device, None
        try:
            create_tiny_model(path, arch=shape.arch, preset="small", seed=0, device=self.device, **shape.fields)
        except Exception:  # noqa: BLE001 - drawn on the CPU instead; the report keeps why
            fallback = traceback.format_exc(limit=3)
            drawn_on = "cpu"
            create_tiny_model(path, arch=shape.arch, preset="small", seed=0, device="cpu", **shape.fields)
        self.notes[name] = {"shaped_like": shape.origin, "arch": shape.arch, "parameters": count_parameters(path),
                            "drawn_on": drawn_on, "build_s": round(time.perf_counter() - start, 2),
                            **({"device_draw_error": fallback} if fallback else {})}
        return path

    def adapter(self, name: str) -> Path:
        """A rank-`lora_rank` adapter of model `name` on all seven projections, with a random B."""
        path = self.root / f"{name}-lora"
        if (path / "adapter_model.safetensors").exists():
            return path
        from coserve.contract.training_settings import LoRASettings
        from coserve.model.config import ModelConfig
        from coserve.trainer import TrainableLoRA

        cfg = ModelConfig.from_pretrained(self.model(name))
        settings = LoRASettings(r=self.sizes.lora_rank, lora_alpha=self.sizes.lora_alpha, target_modules=LORA_TARGETS)
        lora = TrainableLoRA.init(cfg, settings, seed=1)
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for b in lora.b.values():
                b.copy_(torch.randn(b.shape, generator=generator) * self.sizes.lora_b_std)
        return lora.save_pretrained(path, base_model_name_or_path=str(self.model(name)))


def random_prompts(vocab_size: int, count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """`count` prompts of random ids, lengths drawn in `lengths`; ids >= 16 (the tokenizer's special
    tokens have the lowest ids in coserve's tiny tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=g).tolist()
    return [torch.randint(16, vocab_size, (n,), generator=g).tolist() for n in sizes]
