"""Adapters being trained, as vLLM samples them (a reinforcement job's rollouts on `--engine vllm`).

coserve's own engine samples a job's adapter from the bank slot the trainer writes: no copy. vLLM keeps
its own copy of every adapter it samples from, so here the trainer's current weights are written to a
folder (`TrainingRuntime.export_adapter`) and loaded into vLLM under a new id the first time a request
samples them after an optimizer step: one export and one load per step whose weights are sampled. That
is the weight sync the native engine does not pay; `export_s` and `exports` measure it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from coserve.trainer.runtime import TrainingRuntime
from coserve.vllm.backend import VllmRuntime


class TrainingAdapters:
    """vLLM's requests for the adapters jobs are training, one export per optimizer step (module docstring)."""

    def __init__(self, training: TrainingRuntime, runtime: VllmRuntime) -> None:
        self._training, self._runtime = training, runtime
        self._dir = tempfile.TemporaryDirectory(prefix="coserve-vllm-training-", ignore_cleanup_errors=True)
        self._root = Path(self._dir.name)  # removed with this object
        self._current: dict[int, tuple[str, Any]] = {}  # bank slot -> (job id, vLLM's request) of these weights
        self.export_s = 0.0  # seconds spent writing and loading exports
        self.exports = 0

    def lora(self, slot: int) -> Any:
        """vLLM's request for the weights the job training in `slot` has now.

        Raises:
            KeyError: no adapter is loaded in that slot and no job trains there.
        """
        current = self._current.get(slot)
        if current is not None:
            return current[1]
        start = time.perf_counter()
        path = self._root / f"slot-{slot}"
        job_id = self._training.export_adapter(slot, path)
        if job_id is None:
            raise KeyError(f"no adapter in bank slot {slot}, and no job trains there")
        request = self._runtime.lora(str(path))
        self._current[slot] = (job_id, request)
        self.export_s += time.perf_counter() - start
        self.exports += 1
        return request

    def stepped(self, job_ids: Iterable[str]) -> None:
        """These jobs' weights changed (an optimizer step, or the job ended): their slots export again
        when sampled."""
        changed = set(job_ids)
        slots = {self._training.slot_of(job_id) for job_id in changed}
        for slot, (job_id, _) in list(self._current.items()):
            if job_id in changed or slot in slots:
                del self._current[slot]
