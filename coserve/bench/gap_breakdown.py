"""Where a co-serving run's fine-tuning falls short of the bound: the gap split into parts, measured from
the iterations' own timings.

The bound (`headroom`) gives fine-tuning everything inference's marginal work leaves of the window, at
fine-tuning alone's speed r:  ``bound = r * (W - I) / W``. What the run trained, T tokens, took ``T / r``
of fine-tuning alone's time. So the gap, in seconds of the window, is

    gap_s = W - I - T / r

and it splits exactly into terms, each the run's own seconds minus what fine-tuning alone spends per
trained token on the same thing (times T): every executed iteration's measured time is split by the
fitted latency model into its constant, inference's marginal work (I), fine-tuning's token work, the
fixed costs of its pieces, the adapter and other terms, and the model's error (measured minus
predicted); the host's time between the engine's steps and the idle time (no iteration) complete the
window. The run's iterations without fine-tuning are split by why the policy held the job back
(`HoldKind`: the TTFT guard, admission, slack not banked for a burst, the iteration full at the SLO) or
because the job had no work ready. Fine-tuning work done but not in an optimizer step completed in the
window (the step in flight at the window's end, work redone after a KV reclaim) and the difference
between the two estimates of fine-tuning alone (`headroom` takes the higher) are the window's edges,
one term. An iteration running past the window's end counts by its part inside the window.

A quick run's window holds only a few optimizer steps of 256-1024 tokens, so its trained tokens/s move
by a whole step (15-25%) with where the window cuts. `work_tokens_per_s` counts the fine-tuning work
done instead, finished into a step or not, at fine-tuning alone's trained tokens per unit of work: the
two runs train the same sequences in the same order, so it is the trained-tokens rate without the cut
(work redone after a KV reclaim would count twice; the runs report none).

The coefficients are the benchmark's fitted model; a term's split depends on them, the total does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.bench.headroom import INFERENCE_FEATURES
from coserve.bench.replay import IterationRecord, RunRecord
from coserve.planner.latency import LatencyModel

FINETUNE_FEATURES = ("ft_forward_tokens", "ft_backward_token_layers")
PIECE_FEATURES = ("ft_pieces",)
NO_WORK = "no_work_ready"  # iterations without fine-tuning whose job had none ready (nothing held it)
IDLE_ONLY = "no_request"  # iterations without fine-tuning and without requests
WINDOW_EDGES = "window edges (steps unfinished at its end, fine-tuning alone's estimate)"


@dataclass(slots=True)
class WindowSplit:
    """Seconds of a run's window by what they went to (iterations that started in the window)."""

    constant_s: float = 0.0  # iterations carrying fine-tuning: their constant
    inference_s: float = 0.0  # inference's marginal work (every iteration)
    finetune_s: float = 0.0  # fine-tuning's token work (forward tokens, backward token-layers)
    pieces_s: float = 0.0  # fine-tuning pieces' fixed costs
    other_s: float = 0.0  # adapter terms (distinct adapters, adapter loads)
    error_s: float = 0.0  # measured engine time minus the model's prediction, iterations carrying fine-tuning
    host_s: float = 0.0  # between the engine's steps: planning, applying results (iterations with fine-tuning)
    idle_s: float = 0.0  # no iteration running
    without_finetune_s: dict[str, float] = field(default_factory=dict)  # the rest of iterations without
    # fine-tuning (their constant, other terms, error and host time), by why the job sat them out

    @property
    def total_s(self) -> float:
        return (self.constant_s + self.inference_s + self.finetune_s + self.pieces_s + self.other_s
                + self.error_s + self.host_s + self.idle_s + sum(self.without_finetune_s.values()))


def _part(model: LatencyModel, iteration: IterationRecord, names: tuple[str, ...]) -> float:
    coefficients, features = model.coefficients, iteration.features
    return float(sum(coefficients.get(name, 0.0) * getattr(features, name) for name in names))


def split_window(record: RunRecord, model: LatencyModel) -> WindowSplit:
    """The window's seconds by what they went to (module docstring); an iteration that runs past the
    window's end counts by the part of it inside (`IterationRecord.inside`)."""
    out, busy = WindowSplit(), 0.0
    constant = model.coefficients.get("constant", 0.0)
    for iteration in record.iterations:
        share = iteration.inside(record.window_s)
        if not share:
            continue
        wall = iteration.end_s - iteration.start_s
        busy += share * wall
        inference, finetune = _part(model, iteration, INFERENCE_FEATURES), _part(model, iteration, FINETUNE_FEATURES)
        pieces = _part(model, iteration, PIECE_FEATURES)
        out.inference_s += share * inference
        if finetune or pieces:
            predicted = model.predict(iteration.features)
            out.finetune_s += share * finetune
            out.pieces_s += share * pieces
            out.constant_s += share * constant
            out.other_s += share * (predicted - constant - inference - finetune - pieces)
            out.error_s += share * (iteration.engine_s - predicted)
            out.host_s += share * (wall - iteration.engine_s)
        else:
            why = iteration.held.value if iteration.held is not None else \
                NO_WORK if iteration.features.num_sequences else IDLE_ONLY
            rest = share * (wall - inference)
            out.without_finetune_s[why] = out.without_finetune_s.get(why, 0.0) + rest
    out.idle_s = record.window_s - busy
    return out


def measured_over_predicted(record: RunRecord, model: LatencyModel, with_finetune: bool) -> float | None:
    """Measured engine seconds over the model's prediction, summed over the window's iterations with
    (or without) fine-tuning work that computed something; None without such iterations. The bound and
    the terms use the model: a ratio away from 1 says by how much the machine ran faster or slower than
    the model predicts (a bias, or its speed moving since the calibration)."""
    measured = predicted = 0.0
    for iteration in record.iterations:
        share = iteration.inside(record.window_s)
        carries = bool(_part(model, iteration, FINETUNE_FEATURES + PIECE_FEATURES))
        if share and iteration.has_work and carries == with_finetune:
            measured += share * iteration.engine_s
            predicted += share * model.predict(iteration.features)
    return measured / predicted if predicted > 0 else None


def work_per_token_s(record: RunRecord, model: LatencyModel) -> float | None:
    """Fine-tuning token work (model seconds) per trained token of the run's completed optimizer steps:
    the work of every iteration up to the one that completed the last step, over their trained tokens."""
    work, tokens, per_token = 0.0, 0, None
    for iteration in record.iterations:
        work += _part(model, iteration, FINETUNE_FEATURES)
        if iteration.trained_tokens:
            tokens += iteration.trained_tokens
            per_token = work / tokens
    return per_token


def work_tokens_per_s(record: RunRecord, model: LatencyModel, per_token_s: float | None) -> float:
    """The fine-tuning token work a run did in its window, finished into a step or not, as trained
    tokens/s at `per_token_s` (`work_per_token_s` of fine-tuning alone: both runs train the same
    sequences in the same order); 0.0 without a per-token figure."""
    if not per_token_s:
        return 0.0
    return split_window(record, model).finetune_s / per_token_s / record.window_s


def trained_tokens(record: RunRecord) -> int:
    """Trained tokens of the optimizer steps completed by the window's end (as `run_metrics` counts)."""
    return sum(it.trained_tokens for it in record.iterations if it.end_s <= record.window_s)


@dataclass(frozen=True, slots=True)
class GapBreakdown:
    """One rate's gap to the bound, seconds of the window by term (module docstring), and as tokens/s."""

    rate: float
    window_s: float
    finetune_alone_tokens_per_s: float  # r: the bound's estimate of fine-tuning alone
    bound_tokens_per_s: float
    trained_tokens_per_s: float  # of optimizer steps completed in the window
    work_tokens_per_s: float  # the fine-tuning token work done in the window, as trained tokens/s (below)
    terms_s: dict[str, float]
    speed: dict[str, float | None] = field(default_factory=dict)  # `measured_over_predicted` by iterations

    @property
    def gap_s(self) -> float:
        return sum(self.terms_s.values())

    def tokens_per_s(self, seconds: float) -> float:
        """Fine-tuning tokens/s that `seconds` of the window are worth at fine-tuning alone's speed."""
        return seconds * self.finetune_alone_tokens_per_s / self.window_s

    def to_dict(self) -> dict[str, object]:
        return {"rate": self.rate, "bound_tokens_per_s": self.bound_tokens_per_s,
                "trained_tokens_per_s": self.trained_tokens_per_s, "work_tokens_per_s": self.work_tokens_per_s,
                "gap_s": self.gap_s,
                "terms_s": dict(self.terms_s),
                "terms_tokens_per_s": {k: self.tokens_per_s(v) for k, v in self.terms_s.items()},
                "measured_over_predicted": dict(self.speed)}


def gap_breakdown(record: RunRecord, alone: RunRecord, model: LatencyModel,
                  finetune_alone_tokens_per_s: float) -> GapBreakdown:
    """The gap of `record` (a co-serving run) to its bound, with `alone` the fine-tuning-alone run and
    `finetune_alone_tokens_per_s` the bound's estimate of its speed (at least its window rate)."""
    ours, solo = split_window(record, model), split_window(alone, model)
    tokens, solo_tokens = trained_tokens(record), trained_tokens(alone)
    per_work = work_per_token_s(alone, model)
    per_token = 1.0 / solo_tokens if solo_tokens else 0.0
    r, window = finetune_alone_tokens_per_s, record.window_s

    def extra(mine: float, theirs: float) -> float:  # the run's seconds minus fine-tuning alone's for T tokens
        return mine - tokens * theirs * per_token

    solo_constant = solo.constant_s + sum(solo.without_finetune_s.values())
    terms = {
        "iteration constants (with fine-tuning)": extra(ours.constant_s, solo_constant),
        "pieces' fixed costs": extra(ours.pieces_s, solo.pieces_s),
        "model error (measured - predicted)": extra(ours.error_s, solo.error_s),
        "host time between steps": extra(ours.host_s, solo.host_s),
        "adapter and other terms": extra(ours.other_s, solo.other_s),
        "idle (no iteration)": extra(ours.idle_s, solo.idle_s),
        # The window's edges: work of steps unfinished at its end, and fine-tuning alone's two speed
        # estimates (the bound's r against its own window's T/W).
        WINDOW_EDGES: extra(ours.finetune_s, solo.finetune_s)
        + (tokens * (solo.total_s * per_token - (1.0 / r if r else 0.0)) if solo_tokens else 0.0),
    }
    for why, seconds in sorted(ours.without_finetune_s.items()):
        terms[f"iterations without fine-tuning: {why}"] = seconds
    bound = r * (window - ours.inference_s) / window
    speed = {"inference alone": measured_over_predicted(record, model, with_finetune=False),
             "with fine-tuning": measured_over_predicted(record, model, with_finetune=True),
             "fine-tuning alone": measured_over_predicted(alone, model, with_finetune=True)}
    return GapBreakdown(record.rate, window, r, bound, tokens / window, work_tokens_per_s(record, model, per_work),
                        terms, speed)
