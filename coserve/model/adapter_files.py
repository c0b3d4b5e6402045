"""A PEFT LoRA folder checked without loading its weights, torch-free: `adapter_config.json`'s features
and the safetensors header's tensor names and shapes, against the base model and the bank's rank
limit. The gateway checks a fine-tuned model's adapter here before a request uses it (its process
loads no torch); the engine's bank (`coserve.forward.lora`) runs the same check before it loads the
tensors.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from coserve.contract.training_settings import TARGET_MODULES
from coserve.model.config import ModelConfig

WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served: missing files, unsupported modules, rank too large."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """The parts of PEFT's adapter_config.json that the forward needs."""

    r: int
    lora_alpha: float
    use_rslora: bool

    def scale(self, rank: int) -> float:
        return self.lora_alpha / (math.sqrt(rank) if self.use_rslora else rank)


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """A checked adapter folder: its config, its rank, and the tensor names of each (layer, module)'s
    `lora_A` and `lora_B` (as `{"A": name, "B": name}`)."""

    config: AdapterConfig
    rank: int
    tensors: dict[tuple[int, str], dict[str, str]]


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """Read and validate a PEFT `adapter_config.json`.

    Raises:
        AdapterError: missing file or a feature coserve does not serve.
    """
    cfg_path = Path(path) / "adapter_config.json"
    if not cfg_path.is_file():
        raise AdapterError(f"no adapter_config.json in {path}: not a PEFT LoRA adapter folder")
    raw = json.loads(cfg_path.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {path} is {raw.get('peft_type')}, only LORA is supported")
    unsupported = [k for k in ("use_dora", "modules_to_save", "alpha_pattern", "rank_pattern")
                   if raw.get(k)]
    if raw.get("bias", "none") != "none":
        unsupported.append(f"bias={raw['bias']}")
    if unsupported:
        raise AdapterError(f"adapter {path} uses unsupported PEFT features: {', '.join(unsupported)}")
    return AdapterConfig(r=int(raw["r"]), lora_alpha=float(raw.get("lora_alpha", raw["r"])),
                         use_rslora=bool(raw.get("use_rslora", False)))


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the safetensors header (no tensor is read)."""
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"no {WEIGHTS_FILE} in {path}")
    try:
        with safe_open(str(weights_path), framework="numpy") as weights:
            return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    except Exception as error:  # noqa: BLE001 - safetensors' own error type: a file it cannot read
        raise AdapterError(f"adapter {path}: {WEIGHTS_FILE} cannot be read ({error})") from error


def _group(path: Path, names: list[str], cfg: ModelConfig) -> dict[tuple[int, str], dict[str, str]]:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in names:
        match = _KEY.search(name)
        if match is None:
            raise AdapterError(f"adapter {path}: unsupported weight {name!r}; LoRA may target only "
                               f"{', '.join(TARGET_MODULES)} of the decoder layers")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in TARGET_MODULES or layer >= cfg.num_layers:
            raise AdapterError(f"adapter {path}: unsupported target module {module!r} (layer {layer});"
                               f" supported: {', '.join(TARGET_MODULES)}")
        found.setdefault((layer, module), {})[which] = name
    if not found:
        raise AdapterError(f"adapter {path} has no LoRA weights")
    return found


def check_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> AdapterLayout:
    """Check that the PEFT LoRA folder at `path` fits this model and a bank of `max_rank`.

    Raises:
        AdapterError: missing files, unsupported modules or features, wrong shapes, a rank above
            `max_rank`.
    """
    path = Path(path)
    config = read_adapter_config(path)
    shapes = _tensor_shapes(path)
    tensors = _group(path, list(shapes), cfg)
    expected = cfg.linear_shapes()
    rank = 0
    for (layer, module), pair in tensors.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {path}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = shapes[pair["A"]], shapes[pair["B"]]
        r = a[0]
        rank = max(rank, r)
        d_in, d_out = expected[module]
        if a != (r, d_in) or b != (d_out, r):
            raise AdapterError(f"adapter {path}: {module} of layer {layer} has shapes {a}/{b}, model "
                               f"expects ({r}, {d_in})/({d_out}, {r})")
    if rank > max_rank:
        raise AdapterError(f"adapter {path} has rank {rank}, above the bank's max_lora_rank {max_rank}")
    return AdapterLayout(config, rank, tensors)
