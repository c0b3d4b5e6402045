"""How many dedicated-run workers the Ray cluster can hold at once, read from Ray when asked.

The gateway refuses a job that asks for more workers than this (a 400 naming `training.workers` and the
cluster's resources), and `coserve serve` refuses to start when the workers it would route jobs to
(`--dedicated-workers`) could never be placed: such a run would wait for resources forever. A job within
the capacity may still wait while other runs hold the workers; its events say so.
"""

from __future__ import annotations

from collections.abc import Mapping

from coserve.finetune.dedicated import DedicatedSettings, capacity, capacity_text


class ClusterTooSmall(RuntimeError):
    """The cluster can never place the dedicated workers the server's settings ask for."""


class ClusterCapacity:
    """The cluster's room for dedicated workers beyond what the server's own actors keep.

    Args:
        settings: the server's dedicated settings (a worker's resources, the default worker count).
        reserved: resources the serving actors hold for good (the engine's GPU).
    """

    def __init__(self, settings: DedicatedSettings, reserved: Mapping[str, float] | None = None) -> None:
        self.settings = settings
        self._reserved = dict(reserved or {})

    @property
    def default_workers(self) -> int:
        return self.settings.default_workers

    def refusal(self, workers: int) -> str | None:
        """Why `workers` workers can never run at once on this cluster (None: they can)."""
        shortfall = self._shortfall(workers)
        return None if shortfall is None else f"training.workers={workers} is {shortfall}"

    def _shortfall(self, workers: int) -> str | None:
        import ray

        total: dict[str, float] = ray.cluster_resources()
        per_worker = self.settings.per_worker()
        room = capacity(total, per_worker, self._reserved)
        if workers <= room:
            return None
        held = f", less {self._reserved} the serving actors hold" if self._reserved else ""
        return (f"more than this Ray cluster can run at once: at most "
                f"{capacity_text(total, per_worker, room)}{held}")

    def check_default(self) -> None:
        """At start: the routed jobs' worker count must fit (only when the operator routes jobs).

        Raises:
            ClusterTooSmall: it never would; the message names the flag and the cluster.
        """
        workers = self.settings.default_workers
        shortfall = None if self.settings.min_trained_tokens is None else self._shortfall(workers)
        if shortfall is not None:
            raise ClusterTooSmall(f"--dedicated-workers {workers} is {shortfall}")
