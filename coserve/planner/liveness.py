"""Liveness of fine-tuning: while a job is runnable, fine-tuning gets a minimum share of the engine's
time whatever the SLO, or the policy says why not.

A co-serving policy gives fine-tuning what inference leaves (the hybrid policy: what its latency model
says fits under the TPOT SLO). Under a tight SLO, a tiny token budget, a slow machine or a wrong latency
model that can be nothing, iteration after iteration: the job would sit in `running` forever. This is
the rule that forbids it:

- **Minimum share.** While fine-tuning jobs are runnable, fine-tuning gets `min_share`
  (`--finetune-min-share`, default 0.05) of the engine's time, less at most one piece, over any window
  of about `MIN_SHARE_WINDOW_S` (`share_account.ShareAccount` keeps the account: each iteration's
  measured time, and fine-tuning's part of it: its measured backward, optimizer steps and saves, plus
  its forward windows' part of the fused forward as the latency model prices it). Before a plan is
  filled, the floor works out what fine-tuning is owed, this iteration included. When a piece is due,
  the job that waited longest gets one (a forward window, or backward tasklets) whose cost the model
  puts at what is owed, whatever the SLO, the waiting queue, the TTFT guard or the virtual token
  counters say (the counters are charged as usual), or what the share would give that job if that is
  more (`at_least`); one job's piece is at most a window or a run of tasklets of its sequence, so a
  larger debt goes on to the next job in turn. Work the share gives counts too: the floor only tops
  it up.
- **Pieces worth their cost.** Every piece carries a fixed cost (`ft_pieces` in the model: on a CPU a
  few milliseconds), so a piece is due once the debt is worth the least piece: `EFFICIENT_PIECE` times
  that fixed cost in work, and `min_piece_tokens` tokens (a forward window is then at least 3/4 token
  work; a backward budget runs as one tasklet per layer, as when the job trains alone, and is sized in
  whole layers by the job's `layer_tokens`), or half of what a window owes if that is less: a slow
  machine's least piece is given anyway, and the next waits until the surplus is paid off. So on
  average fine-tuning gets exactly its share, a job trains about as fast as `min_share` of its speed
  alone, and it finishes within 1.5 / `min_share` times its time alone (tests/planner/test_min_share.py;
  measured on SmolLM2: benchmarks/RESULTS.md).
- **Forward room.** A forward window shares the iteration's token budget with inference: when a
  forward piece is due, its tokens (at most half the budget) are kept from inference before it is
  scheduled.
- **What it costs.** While jobs are runnable and the share gives them nothing, inference loses
  `min_share` of the engine's time: one iteration in several is longer by a piece, and the mean time
  per output token is about 1 / (1 - `min_share`) of what inference alone takes (5.3% more at 0.05).
- **Why not.** Each plan that gives runnable jobs nothing records the reason (`held_back`), which the
  scheduler's watchdog writes as a job event when a job has not moved for a while.

What can still stop a job is memory: a job whose piece finds no free KV block or adapter slot (inference
holds them; training borrows memory, inference owns it) waits, and `held_back` says so. A sequence that
inference's KV reclaim dropped too often keeps its blocks (`finetune.sequence_kv`).
"""

from __future__ import annotations

from typing import NamedTuple

from coserve.contract.job_spec import JobPhase
from coserve.contract.plan import IterationPlan, StepTimings
from coserve.contract.training_plan import TrainingWork
from coserve.finetune.roster import Allowance, TrainingJob
from coserve.planner.hold_kind import HoldKind
from coserve.planner.latency import LatencyModel, PlanFeatures
from coserve.planner.share_account import PlannedSplit, ShareAccount

NO_MEMORY = "held back: no free KV block or adapter slot for its next piece (inference holds them)"
MIN_SHARE_WINDOW_S = 1.0
"""The window over which fine-tuning gets its minimum share of the engine's time, seconds."""
EFFICIENT_PIECE = 3.0
"""A floor piece's token work costs at least this many times a piece's fixed cost (by the model)."""



class _Prices(NamedTuple):
    """What the latency model says a piece, a forward token and a backward token-layer add to any plan
    (its coefficients: the model is linear)."""

    piece: float
    forward: float
    backward: float

    @classmethod
    def of(cls, latency: LatencyModel) -> _Prices:
        coefficients = latency.coefficients
        return cls(coefficients["ft_pieces"], coefficients["ft_forward_tokens"],
                   coefficients["ft_backward_token_layers"])


def _has_work(training: TrainingWork) -> bool:
    return bool(training.forward_windows or training.backward_tasklets)


def at_least(floor: Allowance, share: Allowance | None) -> Allowance:
    """The floor's piece for a job, or what the share would give it where that is more (each amount): a
    job is asked once per plan, so the floor's piece must not cut what the share had room for."""
    if share is None:
        return floor

    def allow(job: TrainingJob, plan: IterationPlan) -> tuple[int, int] | None:
        mine = floor(job, plan)
        if mine is None:  # the plan carries what the floor owes: the share fills the rest in its order
            return None
        theirs = share(job, plan) or (0, 0)
        return max(mine[0], theirs[0]), max(mine[1], theirs[1])

    return allow


class FinetuneFloor:
    """Gives fine-tuning its minimum share of the engine's time; says why jobs wait (module docstring).

    Args:
        min_share: fine-tuning's least share of the engine's time while a job is runnable, in (0, 1).
        min_piece_tokens: the smallest floor piece (forward tokens, or backward token-layers), >= 1.
        max_batch_tokens: the iteration's token budget (inference and forward windows share it).
        max_backward_token_layers: the most backward work a floor piece may have.
        window_s: the window the share holds over, seconds.
    """

    def __init__(self, min_share: float, min_piece_tokens: int, max_batch_tokens: int,
                 max_backward_token_layers: int, window_s: float = MIN_SHARE_WINDOW_S) -> None:
        if not 0.0 < min_share < 1.0 or min_piece_tokens < 1:
            raise ValueError(f"the fine-tuning floor needs 0 < min_share < 1 and min_piece_tokens >= 1, got "
                             f"{min_share!r}, {min_piece_tokens!r}")
        self.min_share = min_share
        self.min_piece_tokens = min_piece_tokens
        # Forward windows share the token budget with inference: the floor takes at most half of it.
        self.max_forward_tokens = max(1, max_batch_tokens // 2)
        self.max_backward_token_layers = max(min_piece_tokens, max_backward_token_layers)
        self.account = ShareAccount(min_share, window_s)
        self.held_back: str | None = None  # why the last plan gave runnable jobs nothing
        self.held_kind: HoldKind | None = None  # and that reason's kind
        self._reason: tuple[HoldKind, str] | None = None  # what the allowance said in the plan being built
        self._last_inference = PlanFeatures()  # the last plan's inference (the next one's guess)
        self._price = _Prices(0.0, 0.0, 0.0)  # the model's prices in the plan being built (`begin`)

    # ------------------------------------------------------------------------------ the account

    def begin(self, runnable: bool, latency: LatencyModel) -> None:
        """A plan starts; `runnable`: whether a job is runnable (else the account is cleared); `latency`:
        the model the plan is built with (its prices are read once per plan)."""
        if not runnable:
            self.account.clear()
        else:
            self._price = _Prices.of(latency)

    def planned(self, step_id: int, latency: LatencyModel, base: PlanFeatures, training: TrainingWork) -> None:
        """The plan `step_id` was built with inference `base` and fine-tuning `training`: the account takes
        how the model divides it (only while a job is runnable: `begin`)."""
        self._last_inference = base
        price = self._price
        windows = len(training.forward_windows)
        forward_s = training.forward_tokens * price.forward + windows * price.piece
        finetune_s = forward_s + training.backward_token_layers * price.backward + len(training.backward_tasklets) \
            * price.piece
        inference_s = latency.predict(base)
        if not base.has_inference:
            part = forward_part = 1.0 if windows or training.backward_tasklets else 0.0
        else:
            part = finetune_s / (inference_s + finetune_s) if inference_s + finetune_s > 0 else 0.0
            forward_part = forward_s / (inference_s + forward_s) if inference_s + forward_s > 0 else 0.0
        self.account.planned(step_id, PlannedSplit(inference_s + finetune_s, part, forward_part))

    def observe(self, step_id: int, timings: StepTimings) -> None:
        """The plan's result: its measured times (a total <= 0: not measured, the prediction counts)."""
        self.account.observe(step_id, timings.total_s, timings.backward_s)

    def owed_s(self, inference_s: float) -> float:
        """Fine-tuning time the plan being built owes beside `inference_s` of inference, both in the
        model's seconds (the account's measured seconds over its measured / predicted scales)."""
        account = self.account
        return account.owed_s(inference_s * account.inference_scale) / account.finetune_scale

    # ------------------------------------------------------------------------------ the piece

    def _piece_s(self, latency: LatencyModel, price: _Prices, inference_s: float, phase: JobPhase) -> float | None:
        """What a floor piece beside `inference_s` for a job in `phase` may cost (the model's seconds), or
        None when none is due: fine-tuning is owed less than the least piece worth its cost
        (`EFFICIENT_PIECE` times a piece's fixed cost in work, and `min_piece_tokens`), or than half of
        what a window owes if that is less (a slow machine's least piece is given anyway, and the
        surplus waits)."""
        owed_s = self.owed_s(inference_s)
        if owed_s <= 0 or not latency.trusted:
            return owed_s if owed_s > 0 else None
        unit_s = price.forward if phase is JobPhase.FORWARD else price.backward
        least_s = max((1.0 + EFFICIENT_PIECE) * price.piece, price.piece + self.min_piece_tokens * unit_s)
        half_window_s = self.account.window_debt_s / 2 / self.account.finetune_scale
        if owed_s < min(least_s, half_window_s):
            return None
        return max(owed_s, least_s)

    def _tokens(self, trusted: bool, price: _Prices, piece_s: float, unit_s: float, cap: int) -> int:
        """The most tokens at `unit_s` each that one piece fits in `piece_s` (the model's seconds), at least
        `min_piece_tokens`, at most `cap` (the model is linear: a piece costs the same beside any plan)."""
        if not trusted:
            return min(self.min_piece_tokens, cap)
        fitted = cap if unit_s <= 0 else max(0, int((piece_s - price.piece) // unit_s))
        return min(max(fitted, self.min_piece_tokens), cap)

    def _backward(self, trusted: bool, price: _Prices, piece_s: float, layers: tuple[int, int], cap: int) -> int:
        """Backward token-layers that cost about `piece_s`. A budget over several layers runs as one
        tasklet per layer, each with a piece's fixed cost: with `layers` (the tokens left in the job's
        current layer, and in a whole one) it is the current layer's rest and as many whole layers as
        fit; less than the current layer's rest is one piece of it (`_tokens`)."""
        left, whole = layers

        def layer_s(tokens: int) -> float:
            return price.piece + tokens * price.backward

        if not trusted or left <= 0 or layer_s(whole) <= 0:
            return self._tokens(trusted, price, piece_s, price.backward, cap)
        if piece_s < layer_s(left):
            return self._tokens(trusted, price, piece_s, price.backward, min(cap, left))
        return min(cap, max(self.min_piece_tokens, left + int((piece_s - layer_s(left)) // layer_s(whole)) * whole))

    def forward_reserve(self, job: TrainingJob | None, latency: LatencyModel) -> int:
        """Tokens of the budget inference must leave in the plan being built: a forward piece's, when
        `job` (the one the floor serves next) is in its forward phase and a piece is due (by the last
        plan's inference, as this one's is not scheduled yet)."""
        if job is None or job.phase is not JobPhase.FORWARD:
            return 0
        price = self._price
        piece_s = self._piece_s(latency, price, latency.predict(self._last_inference), JobPhase.FORWARD)
        if piece_s is None:
            return 0
        return self._tokens(latency.trusted, price, piece_s, price.forward, self.max_forward_tokens)

    def allowance(self, job: TrainingJob | None, latency: LatencyModel, base: PlanFeatures,
                  max_batch_tokens: int) -> Allowance | None:
        """Pieces for `JobRoster.fill_longest_waiting` beside inference `base`, to the jobs in turn until
        the plan carries what fine-tuning is owed (`_piece_s`, for `job`, the one the floor serves
        first; a job's piece is at most one window or one run of tasklets of its sequence, so a big
        debt takes several jobs); None when none is due."""
        if job is None:
            return None
        price, trusted = self._price, latency.trusted
        piece_s = self._piece_s(latency, price, latency.predict(base), job.phase)
        if piece_s is None:
            return None
        forward_room = min(self.max_forward_tokens, max_batch_tokens - int(base.prefill_tokens + base.decode_tokens))

        def allow(job: TrainingJob, plan: IterationPlan) -> tuple[int, int] | None:
            training = plan.training
            pieces = len(training.forward_windows) + len(training.backward_tasklets)
            left_s = piece_s - (training.forward_tokens * price.forward + pieces * price.piece
                                + training.backward_token_layers * price.backward)
            if pieces and left_s <= 0:
                return None  # the plan carries what is owed
            if job.phase is JobPhase.FORWARD:
                room = max(0, forward_room - training.forward_tokens)
                return self._tokens(trusted, price, left_s, price.forward, room), 0
            room = max(0, self.max_backward_token_layers - training.backward_token_layers)
            return 0, self._backward(trusted, price, left_s, job.layer_tokens, room)

        return allow

    # ------------------------------------------------------------------------------ why not

    def hold(self, kind: HoldKind, reason: str, *, unless_said: bool = False) -> None:
        """Record why the allowance gives fine-tuning nothing in the plan being built (with
        `unless_said`, only when no more specific reason was recorded)."""
        if not (unless_said and self._reason):
            self._reason = (kind, reason)

    def after_plan(self, plan: IterationPlan, has_runnable: bool) -> None:
        """Note why the plan gave runnable jobs nothing (`held_back`, `held_kind`), or that it gave them
        work."""
        starved = has_runnable and not _has_work(plan.training)
        kind, reason = self._reason or (HoldKind.NO_MEMORY, NO_MEMORY)
        self.held_back, self.held_kind = (reason, kind) if starved else (None, None)
        self._reason = None
