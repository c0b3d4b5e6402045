"""How much fine-tuning work an iteration gets: the `FinetuneShare` strategy of a `CoServingPolicy`.

The co-serving policy plans every iteration the same way (inference first, VTC admission, the TTFT
guard, the liveness floor, KV reclaim, the online latency model); what differs between the hybrid
token policy and the baselines is only the share given to fine-tuning. A share strategy says it
through this small protocol, reading the policy through `ShareContext`:

* `hybrid.HybridShare`: what the latency model says fits under the TPOT SLO (the default);
* `temporal.TurnTakingShare`: whole iterations in turns (fixed interval, or FlexLLM's dynamic one);
* `static_split.StaticSplitShare`: a fixed fraction of every iteration (and of the KV cache);
* `fill.FillShare`: what inference leaves of every iteration, with no SLO (the offline `LLM`);
* `NoFinetuneShare`: none (inference only; the policy hosts no jobs).

`share_kinds` builds them by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from coserve.finetune.roster import Allowance
from coserve.inference.request import Request
from coserve.planner.latency import LatencyModel, PlanFeatures
from coserve.planner.liveness import FinetuneFloor
from coserve.planner.settings import CoServingConfig


class ShareContext(Protocol):
    """What a share strategy reads of the co-serving policy that plans with it."""

    @property
    def config(self) -> CoServingConfig: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def running(self) -> Sequence[Request]:
        """The running requests, in admission order."""

    @property
    def now(self) -> float:
        """The clock when the plan being built started."""

    @property
    def latency(self) -> LatencyModel: ...

    @property
    def overrun(self) -> float:
        """Measured / predicted time of recent iterations with fine-tuning work (moving average)."""

    @property
    def floor(self) -> FinetuneFloor:
        """The liveness floor, to which a strategy says why it holds fine-tuning back (`hold`)."""

    def clock(self) -> float:
        """Seconds now, on the scale of `Request.arrival_time`."""

    def overdue_waiting(self) -> Request | None:
        """The oldest waiting request past the TTFT guard when the plan started, else None."""

    def oldest_waiting_arrival(self) -> float | None:
        """When the longest-waiting request not admitted yet arrived, or None when none waits."""

    def has_runnable_job(self) -> bool: ...


class RequestWatcher(Protocol):
    """What a share strategy follows of the requests (the hybrid share's bursts, the dynamic turns'
    load statistics); `IGNORE_REQUESTS` for those that follow nothing."""

    def on_request_added(self, request: Request) -> None:
        """A request was queued."""

    def on_request_finished(self, request: Request) -> None:
        """A request finished (stopped, aborted, or at its length limit)."""

    def on_tokens(self, ctx: ShareContext, touched: Sequence[Request]) -> None:
        """The requests in `touched` received a token in the iteration just applied."""


class _IgnoreRequests:
    def on_request_added(self, request: Request) -> None:
        pass

    def on_request_finished(self, request: Request) -> None:
        pass

    def on_tokens(self, ctx: ShareContext, touched: Sequence[Request]) -> None:
        pass


IGNORE_REQUESTS: RequestWatcher = _IgnoreRequests()


class FinetuneShare(Protocol):
    """The fine-tuning share of each iteration (module docstring).

    Attributes:
        label: how the policy names this share in a job's held-back reason.
        hosts_jobs: whether fine-tuning jobs run under this share at all.
        floor_applies: whether the liveness floor gives starved jobs a piece (turn-taking baselines
            give fine-tuning whole iterations by construction: a piece inside an inference turn would
            break their contract).
        kv_fraction: fine-tuning's own share of the KV cache (a static split: the policy is given that
            range as `finetune_kv`, and inference never takes its blocks); None: fine-tuning borrows
            inference's blocks, and gives them back when inference needs them.
        watcher: what it follows of the requests.
        learns_latency: whether the policy keeps learning the iteration latency model (and warns when the
            TPOT SLO cannot hold); a share with no SLO neither reads nor needs it.
    """

    label: str
    hosts_jobs: bool
    floor_applies: bool
    watcher: RequestWatcher
    learns_latency: bool

    @property
    def kv_fraction(self) -> float | None: ...  # read-only: a share that never splits says None

    def begin_iteration(self, ctx: ShareContext) -> bool:
        """Called once per plan before inference is scheduled: whether this iteration schedules
        inference (temporal sharing gives some iterations to fine-tuning alone)."""

    def inference_token_budget(self, ctx: ShareContext) -> int:
        """Tokens inference may compute in this iteration (a static split keeps a share back)."""

    def allowance(self, ctx: ShareContext, base: PlanFeatures) -> Allowance | None:
        """How much fine-tuning work each job may add to a plan whose inference has `base`; None:
        none (after saying why through `ctx.floor.hold` where there is a specific reason)."""


class NoFinetuneShare:
    """No fine-tuning: the co-serving policy schedules inference alone (VTC order, TTFT guard) and
    hosts no jobs."""

    label = "inference-only share"
    hosts_jobs = False
    floor_applies = False
    kv_fraction = None
    watcher = IGNORE_REQUESTS
    learns_latency = True

    def begin_iteration(self, ctx: ShareContext) -> bool:
        return True

    def inference_token_budget(self, ctx: ShareContext) -> int:
        return ctx.config.scheduler.max_batch_tokens

    def allowance(self, ctx: ShareContext, base: PlanFeatures) -> Allowance | None:
        return None
