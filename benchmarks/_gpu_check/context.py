"""What every part gets: the device, the sizes, the model store, the time left, and device helpers."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from _gpu_check.models import ModelStore
from _gpu_check.shapes import Shape, Workload


@dataclass(slots=True)
class Context:
    device: str  # "cuda", "cuda:1", "cpu"
    quick: bool
    sizes: Workload
    shapes: dict[str, Shape]
    models: ModelStore
    deadline: float  # time.monotonic() by which the whole run should be done
    out_dir: Path  # where the report goes (a part may write a file of its own there)

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """`fn()` and its wall seconds, the device's queue drained before and after."""
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start


def free_memory() -> None:
    """Give the device back what the last engine or model held (call after deleting them). Only where CUDA
    is in use: on the CPU the tiny --quick models do not need it, and a collection costs 0.3 s there."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        gc.collect()
        torch.cuda.empty_cache()


def exact_fp32() -> None:
    """fp32 as fp32: no TF32 in matmuls or convolutions (the parity and gradient checks need it)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
