"""Multi-LoRA: PEFT adapters read from disk, a bank of slots, and the batched delta in the forward.

Each adapter is stored per layer as four fused pairs that mirror the base model's fused projections
(qkv, o, gate_up, down). For a fused pair, A stacks the modules' A matrices ([sum r, in]) and B is
block-diagonal ([sum out, sum r], zeros between modules, scale folded in), so one adapter costs two
small matmuls per projection whatever subset of q/k/v or gate/up it targets.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from coserve.contract.training_settings import TARGET_MODULES
from coserve.model.adapter_files import WEIGHTS_FILE, check_adapter
from coserve.model.config import ModelConfig


class Projection(enum.IntEnum):
    """The base model's fused projections, each carrying the LoRA of its member modules."""

    QKV = 0
    O = 1  # noqa: E741 - the o_proj, as PEFT and transformers name it
    GATE_UP = 2
    DOWN = 3


FUSED_MODULES: dict[Projection, tuple[str, ...]] = {
    Projection.QKV: ("q_proj", "k_proj", "v_proj"),
    Projection.O: ("o_proj",),
    Projection.GATE_UP: ("gate_proj", "up_proj"),
    Projection.DOWN: ("down_proj",),
}
@dataclass(slots=True)
class LoRAPair:
    """One fused projection's LoRA, stored transposed for `x @ a_t @ b_t` (no per-call transposes)."""

    a_t: torch.Tensor  # [in, R]: PEFT's lora_A weights, stacked and transposed
    b_t: torch.Tensor  # [R, out]: block-diagonal lora_B weights, transposed, scale folded in


# One layer of an adapter: a pair (or None) per Projection, indexed by the enum.
AdapterLayer = tuple[LoRAPair | None, LoRAPair | None, LoRAPair | None, LoRAPair | None]


@dataclass(slots=True)
class AdapterWeights:
    adapter_id: int
    rank: int
    target_modules: tuple[str, ...]
    layers: list[AdapterLayer]


def load_peft_adapter(path: str | Path, adapter_id: int, cfg: ModelConfig, max_rank: int,
                      dtype: torch.dtype, device: torch.device) -> AdapterWeights:
    """Load a PEFT LoRA folder into the fused layout, checking it fits this model and bank first
    (`adapter_files.check_adapter`).

    Raises:
        AdapterError: unsupported modules or features, a rank above `max_rank`, wrong shapes.
    """
    path = Path(path)
    checked = check_adapter(path, cfg, max_rank)
    weights = load_file(str(path / WEIGHTS_FILE))
    tensors = {key: {which: weights[name] for which, name in pair.items()}
               for key, pair in checked.tensors.items()}
    shapes = cfg.linear_shapes()
    layers = []
    for i in range(cfg.num_layers):
        present = {m: pair for (layer, m), pair in tensors.items() if layer == i}
        a = {m: pair["A"].to(device, torch.float32) for m, pair in present.items()}
        b = {m: pair["B"].to(device, torch.float32) for m, pair in present.items()}
        scale = {m: checked.config.scale(t.shape[0]) for m, t in a.items()}
        layers.append(contiguous_layer(fuse_layer(a, b, scale, shapes, dtype)))
    modules = tuple(m for m in TARGET_MODULES if any(k[1] == m for k in tensors))
    return AdapterWeights(adapter_id=adapter_id, rank=checked.rank, target_modules=modules, layers=layers)


def fuse_layer(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
               scale: Mapping[str, float], shapes: Mapping[str, tuple[int, int]],
               dtype: torch.dtype) -> AdapterLayer:
    """One layer's LoRA in the bank's fused layout, from per-module A [r, in] and B [out, r].

    Modules absent from `a` are not adapted. Built from cat and scaling only, so it is differentiable:
    the trainer builds its live adapter through it and gradients reach `a` and `b`.
    """
    pairs: list[LoRAPair | None] = []
    for modules in FUSED_MODULES.values():
        present = [m for m in modules if m in a]
        if not present:
            pairs.append(None)
            continue
        a_t = torch.cat([a[m] for m in present]).t()
        # Row block of module m: its scaled B^T under m's output columns, zeros under the others'.
        rows = [torch.cat([b[m].t() * scale[m] if other == m else
                           b[m].new_zeros(a[m].shape[0], shapes[other][1]) for other in modules], dim=1)
                for m in present]
        pairs.append(LoRAPair(a_t=a_t.to(dtype), b_t=torch.cat(rows).to(dtype)))
    return tuple(pairs)  # type: ignore[return-value]


def contiguous_layer(layer: AdapterLayer) -> AdapterLayer:
    """The same pairs as contiguous tensors (what the bank keeps for fast matmuls)."""
    return tuple(None if p is None else LoRAPair(p.a_t.contiguous(), p.b_t.contiguous())
                 for p in layer)  # type: ignore[return-value]


@dataclass(slots=True)
class LoRASegment:
    """Rows [start, end) of the flattened batch run through bank slot `slot`."""

    slot: int
    start: int
    end: int


class LoRABank:
    """A fixed number of adapter slots; the scheduler decides what lives where."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_slots < 0 or max_rank < 1:
            raise ValueError(f"need num_slots >= 0 and max_lora_rank >= 1, got {num_slots}, {max_rank}")
        self.cfg, self.max_rank, self.dtype, self.device = cfg, max_rank, dtype, device
        self.slots: list[AdapterWeights | None] = [None] * num_slots

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"adapter slot {slot} out of range [0, {len(self.slots)})")

    def load(self, slot: int, adapter_id: int, path: str | Path) -> None:
        """Read the PEFT folder at `path` into `slot`, replacing what was there."""
        self._check_slot(slot)
        self.slots[slot] = load_peft_adapter(path, adapter_id, self.cfg, self.max_rank, self.dtype,
                                             self.device)

    def install(self, slot: int, weights: AdapterWeights) -> None:
        """Put in-memory weights (e.g. a trainer's live adapter) into `slot`."""
        self._check_slot(slot)
        self.slots[slot] = weights

    def unload(self, slot: int) -> None:
        self._check_slot(slot)
        self.slots[slot] = None

    def apply(self, proj: Projection, layer: int, x: torch.Tensor, out: torch.Tensor,
              segments: list[LoRASegment]) -> None:
        """out[rows] += (x[rows] @ A^T) @ B^T for each segment's adapter, in place."""
        for seg in segments:
            adapter = self.slots[seg.slot]
            if adapter is None:
                raise RuntimeError(f"adapter slot {seg.slot} is empty but scheduled")
            pair = adapter.layers[layer][proj]
            if pair is not None:
                rows = slice(seg.start, seg.end)
                out[rows].addmm_(x[rows] @ pair.a_t, pair.b_t)
