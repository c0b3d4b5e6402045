"""Liveness of fine-tuning: every runnable job makes progress, or the policy says why not.

A co-serving policy gives fine-tuning what inference leaves (the hybrid policy: what its latency model
says fits under the TPOT SLO). Under a tight SLO, a tiny token budget, a slow machine or a wrong latency
model that can be nothing, iteration after iteration: the job would sit in `running` forever. This is
the rule that forbids it:

- **Floor.** When a runnable job has had no work in the last `every` plans, the next plan keeps
  `tokens` of the iteration's token budget away from inference and gives one piece (a forward window of
  at most `tokens` tokens, or backward tasklets of at most `tokens` token-layers) to the job that has
  waited longest, whatever the SLO, the waiting queue, the TTFT guard or the virtual token counters say
  (the counters are charged as usual). So with n runnable jobs each moves at least once every
  `every` + n iterations, and the cost is bounded: at most n iterations in `every` + n are longer by
  one small piece each.
- **Growth.** A floor piece of 16 tokens is 1/30 of one token's backward on a 30-layer model: under an
  SLO the machine cannot meet, a job fed by the floor alone would take hours. So a job's floor piece
  doubles with each floor piece it has taken in a row (a job the share has not served for k floor
  pieces, about k x (`every` + 1) plans, is offered 16 x 2^k), but only in plans whose inference alone
  the latency model already predicts over the TPOT budget (`growth_room`: the SLO is lost in that
  iteration whatever fine-tuning does), and only up to a piece the model predicts to cost no more
  than that inference (`GROWN_PIECE_COST`), half the token budget (forward) and
  `max_backward_token_layers` (backward). Where inference alone fits the SLO, the piece stays at
  `tokens`: an SLO the machine can meet is never traded for a bigger floor. Any work the share gives
  the job ends the run. So a job held back by an SLO that cannot be met trains, after a ramp of
  log2(piece / 16) floor pieces, about one inference iteration's worth of work every `every` + n
  iterations: roughly 1 / (`every` + n + 1) of the engine's time, and it finishes within about
  (`every` + n + 1) times its time alone on an idle engine (measured on SmolLM2: benchmarks/RESULTS.md).
- **Why not.** Each plan that gives runnable jobs nothing records the reason (`held_back`), which the
  scheduler's watchdog writes as a job event when a job has not moved for a while.

What can still stop a job is memory: a job whose piece finds no free KV block or adapter slot (inference
holds them; training borrows memory, inference owns it) waits, and `held_back` says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from coserve.contract.plan import IterationPlan
from coserve.contract.training_plan import TrainingWork
from coserve.finetune.job import JobPhase
from coserve.finetune.roster import Allowance, TrainingJob
from coserve.share.latency import LatencyModel, PlanFeatures

NO_MEMORY = "held back: no free KV block or adapter slot for its next piece (inference holds them)"
# A grown floor piece may add at most this many times the predicted time of its iteration's inference.
GROWN_PIECE_COST = 1.0
MAX_DOUBLINGS = 20  # the size is capped long before; this only bounds the integer


@dataclass(frozen=True, slots=True)
class GrowthRoom:
    """How big a grown floor piece may be in the plan being built (by the latency model)."""

    forward_tokens: int
    backward_token_layers: int


def growth_room(latency: LatencyModel, base: PlanFeatures, budget_s: float, max_forward_tokens: int,
                max_backward_token_layers: int) -> GrowthRoom | None:
    """The room for a grown floor piece beside `base` (the plan's inference work), or None when the
    floor must not grow: the model is still warming up, or it predicts inference alone within
    `budget_s` (the TPOT SLO can hold in this iteration). Otherwise the largest piece of each kind
    that the model predicts to add at most `GROWN_PIECE_COST` x the inference's own time, as one piece
    (a backward piece over several layers runs as one tasklet per layer, each adding the model's fixed
    cost of a piece: the planner does not see the sequence length, as in `hybrid.py`)."""
    if not latency.trusted:
        return None
    inference_s = latency.predict(base)
    if inference_s <= budget_s:
        return None
    one_piece = base.with_finetune(0, 0, 1)
    limit_s = inference_s * (1.0 + GROWN_PIECE_COST)
    return GrowthRoom(
        latency.max_extra_tokens(one_piece, PlanFeatures(ft_forward_tokens=1.0), limit_s, max_forward_tokens),
        latency.max_extra_tokens(one_piece, PlanFeatures(ft_backward_token_layers=1.0), limit_s,
                                 max_backward_token_layers))


def _has_work(training: TrainingWork) -> bool:
    return bool(training.forward_windows or training.backward_tasklets)


class FinetuneFloor:
    """Forces a small piece for a job that has had no work in `every` plans; says why jobs wait.

    Args:
        every: plans a runnable job may go without work before the next one carries its piece (>= 1).
        tokens: the floor piece's size: forward tokens, or backward token-layers (>= 1).
        max_batch_tokens: the iteration's token budget (inference and forward windows share it).
        max_backward_token_layers: the most backward work a grown piece may have.
    """

    def __init__(self, every: int, tokens: int, max_batch_tokens: int,
                 max_backward_token_layers: int | None = None) -> None:
        if every < 1 or tokens < 1:
            raise ValueError(f"the fine-tuning floor needs every >= 1 and tokens >= 1, got {every}, {tokens}")
        self.every = every
        self.tokens = tokens
        # Forward windows share the token budget with inference: the floor takes at most half of it.
        self.max_forward_tokens = max(1, max_batch_tokens // 2)
        self._forward_tokens = min(tokens, self.max_forward_tokens)
        self.max_backward_token_layers = max(tokens, max_backward_token_layers or tokens)
        self.held_back: str | None = None  # why the last plan gave runnable jobs nothing
        self._reason: str | None = None  # what the allowance said in the plan being built
        self._first_seen: dict[str, int] = {}  # job id -> step id of the first plan that saw it
        self._streak: dict[str, int] = {}  # job id -> floor pieces it took in a row (none from the share)
        self._floor_step: dict[str, int] = {}  # job id -> step id of its last floor piece

    def due(self, step_id: int, jobs: Iterable[TrainingJob]) -> bool:
        """Whether the plan `step_id` must carry a floor piece: a runnable job had no work in the last
        `every` plans (a job that never had any counts from the first plan that saw it)."""
        first_seen, streak, floor_step, due = {}, {}, {}, False
        for job in jobs:
            job_id = job.job_id
            first_seen[job_id] = self._first_seen.get(job_id, step_id)
            last = job.last_planned_step if job.last_planned_step >= 0 else first_seen[job_id] - 1
            due = due or (job.runnable and step_id - last > self.every)
            if job_id in self._floor_step and job.last_planned_step == self._floor_step[job_id]:
                # its last work was a floor piece: the run goes on (work from the share ends it)
                streak[job_id], floor_step[job_id] = self._streak[job_id], self._floor_step[job_id]
        self._first_seen, self._streak, self._floor_step = first_seen, streak, floor_step  # finished jobs drop out
        return due

    def served(self, step_id: int, jobs: Iterable[TrainingJob]) -> None:
        """Note the job that took the floor's piece in plan `step_id` (its run grows by one)."""
        for job in jobs:
            if job.last_planned_step == step_id:
                self._floor_step[job.job_id] = step_id
                self._streak[job.job_id] = self._streak.get(job.job_id, 0) + 1

    def streak(self, job_id: str) -> int:
        """Floor pieces the job has taken in a row, with no work from the share in between."""
        return self._streak.get(job_id, 0)

    def reserved_tokens(self, due: bool) -> int:
        """Tokens of the budget inference must leave to fine-tuning in the plan being built."""
        return self._forward_tokens if due else 0

    def hold(self, reason: str, *, unless_said: bool = False) -> None:
        """Record why the allowance gives fine-tuning nothing in the plan being built (with
        `unless_said`, only when no more specific reason was recorded)."""
        if not (unless_said and self._reason):
            self._reason = reason

    def allowance(self, inference_tokens: int, max_batch_tokens: int,
                  growth: GrowthRoom | None = None) -> Allowance:
        """One piece for `JobRoster.fill_longest_waiting`: the floor's size, or with `growth` (inference
        alone is over the SLO, `growth_room`) 2^k times it for a job in a run of k floor pieces, within
        `growth` and the caps; never less than the floor's size (within the free token budget)."""
        forward_room = max(0, min(self.max_forward_tokens, max_batch_tokens - inference_tokens))

        def allow(job: TrainingJob, plan: IterationPlan) -> tuple[int, int]:
            forward, backward = min(self._forward_tokens, forward_room), self.tokens
            if growth is not None:
                size = self.tokens << min(self.streak(job.job_id), MAX_DOUBLINGS)
                forward = max(forward, min(size, forward_room, growth.forward_tokens))
                backward = max(backward, min(size, self.max_backward_token_layers, growth.backward_token_layers))
            return (forward, 0) if job.phase is JobPhase.FORWARD else (0, backward)

        return allow

    def after_plan(self, plan: IterationPlan, has_runnable: bool) -> None:
        """Note why the plan gave runnable jobs nothing (`held_back`), or that it gave them work."""
        starved = has_runnable and not _has_work(plan.training)
        self.held_back = (self._reason or NO_MEMORY) if starved else None
        self._reason = None
