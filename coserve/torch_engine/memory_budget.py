"""`--gpu-memory-utilization` on coserve's engine, with vLLM's meaning: the fraction of the GPU's total
memory the engine may use, everything included. The KV cache gets what is left of it once the weights
(what this process holds on the device after loading them), the adapter bank, one forward's activations
and one fine-tuning job's reserve are counted (`coserve.model.memory`). A fraction that leaves nothing,
or asks for more than the device has free, is refused at start with the numbers and the flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coserve.contract.kv_capacity import KvCacheTooSmall
from coserve.forward.lora import FUSED_MODULES
from coserve.model.config import ModelConfig
from coserve.model.memory import WorkingSizes, forward_activation_bytes, trainer_reserve_bytes

GIB = 2**30


def bank_slot_bytes(cfg: ModelConfig, rank: int, dtype_bytes: int) -> int:
    """One adapter of `rank` on every projection in the bank's fused layout (`forward.lora.fuse_layer`): a
    fused group of k projections keeps A^T [in, k * rank] and B^T [k * rank, their outputs together]."""
    shapes = cfg.linear_shapes()
    per_layer = 0
    for modules in FUSED_MODULES.values():
        fan_in, fan_out = shapes[modules[0]][0], sum(shapes[m][1] for m in modules)
        per_layer += len(modules) * rank * (fan_in + fan_out)
    return cfg.num_layers * per_layer * dtype_bytes


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The device as measured once the weights are loaded."""

    name: str  # "cuda:0"
    total: int
    free: int


@dataclass(frozen=True, slots=True)
class MemorySplit:
    """What the engine holds beside its KV cache, in bytes."""

    weights: int
    adapter_bank: int
    activations: int
    trainer: int

    @classmethod
    def of(cls, cfg: ModelConfig, dtype_bytes: int, weights: int, adapter_slots: int,
           sizes: WorkingSizes) -> MemorySplit:
        return cls(weights=weights, adapter_bank=adapter_slots * bank_slot_bytes(cfg, sizes.max_lora_rank, dtype_bytes),
                   activations=forward_activation_bytes(cfg, dtype_bytes, sizes),
                   trainer=trainer_reserve_bytes(cfg, dtype_bytes, sizes))

    @property
    def not_yet_allocated(self) -> int:
        """What is counted but not held yet when the cache is sized (all but the weights)."""
        return self.adapter_bank + self.activations + self.trainer

    def words(self) -> str:
        return (f"weights {self.weights / GIB:.2f} GiB, adapter bank {self.adapter_bank / GIB:.2f} GiB, "
                f"activations {self.activations / GIB:.2f} GiB, fine-tuning reserve {self.trainer / GIB:.2f} GiB")

    def kv_cache_bytes(self, device: DeviceMemory, utilization: float) -> int:
        """The KV cache's share of `utilization` x the device's memory.

        Raises:
            KvCacheTooSmall: nothing is left for the cache, or the device has less free than that asks for.
        """
        allowed = utilization * device.total
        budget = int(allowed - self.weights - self.not_yet_allocated)
        if budget <= 0:
            raise KvCacheTooSmall(
                f"--gpu-memory-utilization {utilization:g} gives this engine {allowed / GIB:.2f} GiB of "
                f"{device.name}'s {device.total / GIB:.2f} GiB, and {self.words()} leave nothing for the KV "
                f"cache: raise --gpu-memory-utilization, or lower --max-model-len, --max-batch-tokens or "
                f"--adapter-slots")
        room = device.free - self.not_yet_allocated
        if budget > room:
            raise KvCacheTooSmall(
                f"--gpu-memory-utilization {utilization:g} leaves the KV cache {budget / GIB:.2f} GiB, and "
                f"{device.name} has {device.free / GIB:.2f} GiB free ({self.words()}; other processes hold "
                f"the rest): lower --gpu-memory-utilization, or give --kv-cache-memory-gb")
        return budget


def cuda_kv_cache_bytes(device: torch.device, cfg: ModelConfig, dtype_bytes: int, adapter_slots: int,
                        sizes: WorkingSizes, utilization: float) -> int:
    """The KV cache's bytes on a CUDA `device`, measured once the weights are loaded."""
    free, total = torch.cuda.mem_get_info(device)
    split = MemorySplit.of(cfg, dtype_bytes, torch.cuda.memory_allocated(device), adapter_slots, sizes)
    return split.kv_cache_bytes(DeviceMemory(str(device), total, free), utilization)
