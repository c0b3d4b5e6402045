"""How much fine-tuning any policy could add at a rate: an upper bound from the inference work alone.

On a machine where inference and fine-tuning compete for the same compute (a CPU; a GPU once batches
are large), every policy has to spend at least the *marginal* cost of the inference it serves: the
fitted model's per-token, per-chunk and per-sequence costs of the prompts and decodes, without the
per-iteration constant or the per-adapter term (a policy could in principle share those with
fine-tuning). The rest of the window at best trains as fast as fine-tuning alone, so

    bound = finetune_only_tokens_per_s * (1 - inference_marginal_s / window_s)

(the benchmark passes the higher of its two estimates of fine-tuning alone: the trained tokens of the
steps completed in the window, and the rate between the first and the last completed step; the first
moves by a whole step, 15-45 tok/s in a 16 s window, and one unlucky run put it under what coserve then
trained at rate 3) is above what coserve or any baseline can reach while serving the same requests,
within the model's error (the benchmark prints its held-out MAPE per iteration, 12-20% on the
development machine; the error of a sum over a window's iterations is smaller) and one more term, on a
machine whose speed holds during the run: fine-tuning alone runs the benchmark's coserve policy,
whose iterations last the stall cap (3 TPOT SLOs), so a policy with longer fine-tuning iterations
could save part of their constant (at most its share of such an iteration, ~5-11% here).
Otherwise the bound is generous: it charges inference no iteration constant, though while a request
decodes some iteration has to run at least once per TPOT SLO, and on the development machine that
constant is 20-30% of an SLO, more than it takes of fine-tuning alone. `slo_bound` charges inference
the constants of the iterations the SLO forces; given them, `headroom` reports that tighter bound too.
When 1.3x the best baseline is above a bound, that target cannot be met at that rate on this machine by
any schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coserve.bench.replay import RunRecord
from coserve.bench.slo_bound import ForcedConstants, slo_bound_tokens_per_s
from coserve.planner.latency import LatencyModel

# The features that scale with the inference work served (not with how it is batched into iterations).
INFERENCE_FEATURES = ("prefill_tokens", "decode_tokens", "prefill_attention", "decode_context",
                      "num_sequences", "prefill_chunks")


@dataclass(frozen=True, slots=True)
class Headroom:
    """The bound at one rate, next to what the target asks for."""

    rate: float
    inference_marginal_s: float  # modelled marginal seconds of the inference iterations in the window
    window_s: float
    finetune_bound_tokens_per_s: float
    target_tokens_per_s: float | None  # 1.3x the best baseline keeping the SLO (None: no such baseline)
    forced_iterations: int | None = None  # iterations the SLO forces (`slo_bound`; None: not computed)
    slo_bound_tokens_per_s: float | None = None  # the bound less the forced iterations' constants

    @property
    def inference_marginal_share(self) -> float:
        """The inference work's modelled share of the window."""
        return self.inference_marginal_s / self.window_s

    @property
    def target_feasible(self) -> bool | None:
        """Whether the target is at or under the bound (None without a baseline to compare with)."""
        if self.target_tokens_per_s is None:
            return None
        return self.target_tokens_per_s <= self.finetune_bound_tokens_per_s

    @property
    def target_feasible_slo(self) -> bool | None:
        """Whether the target is at or under the SLO bound (None without one or without a baseline)."""
        if self.target_tokens_per_s is None or self.slo_bound_tokens_per_s is None:
            return None
        return self.target_tokens_per_s <= self.slo_bound_tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "inference_marginal_share": self.inference_marginal_share,
                "finetune_bound_tokens_per_s": self.finetune_bound_tokens_per_s,
                "target_tokens_per_s": self.target_tokens_per_s, "target_feasible": self.target_feasible,
                "forced_iterations": self.forced_iterations, "slo_bound_tokens_per_s": self.slo_bound_tokens_per_s,
                "target_feasible_slo": self.target_feasible_slo}


def inference_marginal_s(record: RunRecord, model: LatencyModel) -> float:
    """Modelled marginal seconds of the inference work inside the window (an iteration across its end
    counts by its part inside)."""
    coefficients = model.coefficients
    total = 0.0
    for iteration in record.iterations:
        share = iteration.inside(record.window_s)
        if share:
            features = iteration.features
            total += share * sum(coefficients.get(name, 0.0) * getattr(features, name)
                                 for name in INFERENCE_FEATURES)
    return total


def headroom(record: RunRecord, model: LatencyModel, finetune_only_tokens_per_s: float,
             best_baseline_tokens_per_s: float | None, target_ratio: float = 1.3,
             forced: ForcedConstants | None = None) -> Headroom:
    """The bound for the requests `record` served (any policy's run at that rate serves the same trace),
    and with `forced` (`slo_bound.forced_constants` of the same run) the SLO bound beside it."""
    marginal = inference_marginal_s(record, model)
    bound = finetune_only_tokens_per_s * max(0.0, 1.0 - marginal / record.window_s)
    target = None if best_baseline_tokens_per_s is None else target_ratio * best_baseline_tokens_per_s
    if forced is None:
        return Headroom(record.rate, marginal, record.window_s, bound, target)
    tighter = slo_bound_tokens_per_s(finetune_only_tokens_per_s, marginal / record.window_s, forced)
    return Headroom(record.rate, marginal, record.window_s, bound, target, forced.iterations, min(bound, tighter))


def best_baseline(runs: list[dict[str, Any]], rate: float, min_attainment: float = 0.9,
                  ours: tuple[str, ...] = ("coserve", "coserve-strict"),
                  key: str = "finetune_tokens_per_s") -> float | None:
    """The highest fine-tuning throughput (`key` of the JSON rows) at `rate` of a baseline keeping
    `min_attainment`."""
    kept = [run[key] for run in runs
            if run["rate"] == rate and run["policy"] not in ours
            and run["slo_attainment"] is not None and run["slo_attainment"] >= min_attainment]
    return max(kept) if kept else None
