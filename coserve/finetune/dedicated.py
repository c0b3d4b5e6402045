"""Dedicated fine-tuning: which jobs leave the shared engines for a Ray Train run of their own, on how
many workers, and whether the cluster can ever hold them (pure Python, no torch, no Ray).

A job asks with the coserve extension `training` (`{"mode": "dedicated", "workers": 2}`, or
`{"mode": "coserved"}` to stay on the engines whatever its size); a job that does not ask is routed by
the operator's threshold (`DedicatedSettings.min_trained_tokens`, `coserve serve --dedicated-min-tokens`,
off by default): one that trains at least that many tokens (its file's trained tokens x its epochs) runs
dedicated on `default_workers` workers. The job row keeps the decision (`TRAINING_KEY` in its
extensions, `coserve.contract.job_request`), so a restarted server runs the job the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from coserve.contract import defaults
from coserve.contract.job_request import MAX_WORKERS, TrainingMode, TrainingRequest

DEFAULT_WORKERS = 2
DEFAULT_MAX_FAILURES = 3  # worker failures a run recovers from (Ray Train's FailureConfig.max_failures)


@dataclass(frozen=True, slots=True)
class DedicatedSettings:
    """The server's dedicated-training settings (plain data: sent to the scheduler actor).

    Args:
        min_trained_tokens: route a job that did not ask to a dedicated run when it trains at least this
            many tokens (None: never; jobs then run dedicated only when they ask).
        default_workers: workers of a dedicated run that did not say (and of a routed job).
        use_gpu: one GPU per worker (NCCL) rather than one CPU (gloo); the engine's device decides.
        dtype: the base model's dtype on the workers (the engine's, so both modes compute alike).
        max_failures: worker failures a run recovers from, from its last checkpoint.
        pause_timeout_s: how long a paused run keeps its workers; then it stops with a checkpoint and gives
            them back, and resuming the job starts a new run from that checkpoint.
    """

    min_trained_tokens: int | None = None
    default_workers: int = DEFAULT_WORKERS
    use_gpu: bool = False
    dtype: str = "auto"
    max_failures: int = DEFAULT_MAX_FAILURES
    pause_timeout_s: float = defaults.DEDICATED_PAUSE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.min_trained_tokens is not None and self.min_trained_tokens < 1:
            raise ValueError(f"--dedicated-min-tokens must be >= 1, got {self.min_trained_tokens}")
        if not 1 <= self.default_workers <= MAX_WORKERS:
            raise ValueError(f"--dedicated-workers must be in 1..{MAX_WORKERS}, got {self.default_workers}")
        if self.max_failures < 0:
            raise ValueError(f"max_failures must be >= 0, got {self.max_failures}")
        if not 0 < self.pause_timeout_s < math.inf:
            raise ValueError(f"--dedicated-pause-timeout-s must be a number > 0, got {self.pause_timeout_s}")

    def per_worker(self) -> dict[str, float]:
        """The Ray resources one worker takes."""
        return {"CPU": 1.0, "GPU": 1.0} if self.use_gpu else {"CPU": 1.0}


@dataclass(frozen=True, slots=True)
class Route:
    """How a job trains: dedicated on `workers` workers, or co-served (`workers` None); `reason` says why
    (for the job's events)."""

    workers: int | None
    reason: str

    @property
    def dedicated(self) -> bool:
        return self.workers is not None


def route(request: TrainingRequest, trained_tokens: int, settings: DedicatedSettings | None) -> Route:
    """Dedicated or co-served for a job whose total trained tokens are `trained_tokens`.

    `settings` None: the server has no dedicated training (no Ray); jobs are co-served (one that asks
    for a dedicated run is refused before it gets here).
    """
    if request.mode == TrainingMode.DEDICATED:
        workers = request.workers or (settings.default_workers if settings else DEFAULT_WORKERS)
        return Route(workers, f"the job asked for a dedicated run on {workers} worker(s)")
    if request.mode == TrainingMode.COSERVED or settings is None or settings.min_trained_tokens is None:
        return Route(None, "co-served")
    if trained_tokens >= settings.min_trained_tokens:
        return Route(settings.default_workers, f"{trained_tokens} trained tokens >= the server's "
                     f"dedicated threshold of {settings.min_trained_tokens} (--dedicated-min-tokens)")
    return Route(None, "co-served")


def capacity(total: Mapping[str, float], per_worker: Mapping[str, float],
             reserved: Mapping[str, float] | None = None) -> int:
    """Workers of `per_worker` resources a cluster of `total` resources can ever hold at once, beyond
    what the server's own actors keep (`reserved`, e.g. the engine's GPU)."""
    reserved = reserved or {}
    counts = [math.floor((total.get(name, 0.0) - reserved.get(name, 0.0)) / amount + 1e-9)
              for name, amount in per_worker.items() if amount > 0]
    return max(0, min(counts)) if counts else 0


def capacity_text(total: Mapping[str, float], per_worker: Mapping[str, float], workers: int) -> str:
    """E.g. `2 worker(s) of {'CPU': 1.0} (the cluster has {'CPU': 2.0})`, for refusals and events."""
    shown = {name: total.get(name, 0.0) for name in per_worker}
    return f"{workers} worker(s) of {dict(per_worker)} (the cluster has {shown})"
