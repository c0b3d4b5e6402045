"""How many engines a server runs (`--engines N`): one per GPU, each pinned to its GPU by Ray; on a CPU
machine one by default, each taking one CPU, at most as many as there are cores.

What is available is read where the engines will run: the Ray cluster's resources once Ray is up (a
KubeRay cluster's GPUs are on its workers, not on the machine that starts the server), this machine's
CUDA devices or cores otherwise. Asking for more engines than that is refused at start
(`EnginesUnavailable`): the engines could never all be placed, and the server would wait for them forever.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


class EnginesUnavailable(ValueError):
    """`--engines` asks for more engines than the machine or the Ray cluster can hold at once."""


@dataclass(frozen=True, slots=True)
class EngineRoom:
    """What the engines take one of each, and how many there are.

    Args:
        resource: "GPU" (one engine per GPU) or "CPU" (an engine on the CPU takes one core).
        available: how many of `resource` there are.
        where: "this machine" or "the Ray cluster" (for messages).
    """

    resource: str
    available: int
    where: str

    @property
    def default(self) -> int:
        """Engines when `--engines` is not given: one per visible GPU, one on a CPU machine."""
        return max(1, self.available) if self.resource == "GPU" else 1

    def count(self, requested: int | None) -> int:
        """The number of engines to run.

        Raises:
            EnginesUnavailable: `requested` is more than `available`.
        """
        if requested is None:
            return self.default
        if requested > self.available:
            per = "one GPU" if self.resource == "GPU" else "one CPU core"
            raise EnginesUnavailable(f"--engines {requested}: {self.where} has {self.available} "
                                     f"{self.resource}(s) and each engine takes {per}")
        return requested


def engine_room(device: str) -> EngineRoom:
    """The room for engines on `device` ("cpu", "cuda"): the Ray cluster's when this process is
    connected to Ray, this machine's otherwise."""
    resource = "GPU" if device.startswith("cuda") else "CPU"
    ray = sys.modules.get("ray")  # connected only if imported: importing Ray to ask would cost a second
    if ray is not None and ray.is_initialized():
        return EngineRoom(resource, int(ray.cluster_resources().get(resource, 0)), "the Ray cluster")
    if resource == "GPU":
        import torch

        return EngineRoom(resource, torch.cuda.device_count(), "this machine")
    return EngineRoom(resource, len(os.sched_getaffinity(0)), "this machine")
