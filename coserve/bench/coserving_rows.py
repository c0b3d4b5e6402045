"""The co-serving benchmark's lines on the console: a run's metrics, the bound at a rate, and the gap to
it by term (`coserving.py` prints them as the runs finish; `benchmarks/coserving_breakdown.py` too)."""

from __future__ import annotations

import os
from typing import Any

from coserve.bench.calibration import LatencyFit
from coserve.bench.gap_breakdown import GapBreakdown
from coserve.bench.headroom import Headroom
from coserve.bench.pacing import Pacing
from coserve.bench.policy_set import PolicySetup


def run_line(run: dict[str, Any]) -> str:
    """One run's metrics (a JSON row of `runs`) on one line."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"
    att = run["slo_attainment"]
    return (f"{run['policy']:>18} rate {run['rate']:<5} SLO {'-' if att is None else f'{att:.2f}'}  "
            f"inference {run['inference_tokens_per_s']:7.1f} tok/s  fine-tuning "
            f"{run['finetune_tokens_per_s']:7.1f} tok/s ({run['finetune_sequences_per_s']:.2f} seq/s, work done "
            f"{run.get('finetune_work_tokens_per_s', 0.0):.1f})  "
            f"TTFT p50/p99 {ms(run['ttft_p50_ms'])}/"
            f"{ms(run['ttft_p99_ms'])} ms  TPOT p50/p99 {ms(run['tpot_p50_ms'])}/{ms(run['tpot_p99_ms'])} ms")


def bound_line(bound: Headroom) -> str:
    target = "-" if bound.target_tokens_per_s is None else f"{bound.target_tokens_per_s:.1f}"
    slo = "" if bound.slo_bound_tokens_per_s is None else \
        (f", any policy keeping the SLO <= {bound.slo_bound_tokens_per_s:.1f} "
         f"({bound.forced_iterations} iterations forced)")
    return (f"{'bound':>18} rate {bound.rate:<5} inference marginal share "
            f"{bound.inference_marginal_share:.2f}: any policy <= "
            f"{bound.finetune_bound_tokens_per_s:.1f} fine-tuning tok/s{slo}; 1.3x best baseline {target}")


def gap_rows(gap: GapBreakdown, best_baseline_work: float | None = None, slo_bound: float | None = None) -> str:
    """The gap to the bound by term, largest first, as fine-tuning tokens/s (and coserve's work done
    against the best baseline's, when there is one keeping the SLO, and against the SLO bound)."""
    against = "" if not best_baseline_work or best_baseline_work <= 0 else \
        f", {gap.work_tokens_per_s / best_baseline_work:.2f}x the best baseline's"
    if slo_bound is not None and slo_bound > 0:
        against += f", {gap.work_tokens_per_s / slo_bound:.0%} of the SLO bound"
    lines = [f"{'gap':>18} rate {gap.rate:<5} coserve {gap.trained_tokens_per_s:.1f} tok/s of completed steps "
             f"({_of(gap.trained_tokens_per_s, gap.bound_tokens_per_s)} of the bound), "
             f"{gap.work_tokens_per_s:.1f} tok/s of work done "
             f"({_of(gap.work_tokens_per_s, gap.bound_tokens_per_s)}{against}); the gap by term, tok/s:"]
    if gap.bound_tokens_per_s <= 0:
        lines.append(f"{'':>24}WARNING: the bound is 0: inference alone took the whole window, so the machine "
                     "was slower than its calibration (is it loaded? see the load average)")
    for name, seconds in sorted(gap.terms_s.items(), key=lambda kv: -abs(kv[1])):
        lines.append(f"{'':>24}{gap.tokens_per_s(seconds):7.1f}  {name}")
    ratios = ", ".join(f"{name} {ratio:.2f}" for name, ratio in gap.speed.items() if ratio is not None)
    lines.append(f"{'':>24}measured / predicted engine time: {ratios}")
    return "\n".join(lines)


def _of(part: float, whole: float) -> str:
    """`part` as a share of `whole`, or "n/a" when there is no whole (a loaded machine's zero bound)."""
    return f"{part / whole:.0%}" if whole > 0 else "n/a"


def pacing_line(paced: Pacing) -> str:
    """How often the run iterated while requests were live, against one iteration per TPOT SLO."""
    if paced.per_tpot is None:
        return f"{'':>24}pacing: no request was live between two tokens in the window"
    return (f"{'':>24}pacing: requests live {paced.live_s / paced.window_s:.0%} of the window, "
            f"{paced.per_tpot:.2f} iterations per TPOT SLO there; their constants "
            f"{paced.constant_share:.1%} of the window (one per TPOT SLO: {paced.paced_constant_share:.1%})")


def calibration_lines(fit: LatencyFit, setup: PolicySetup, seconds: float, load: float) -> str:
    """The calibration's fit and the policies' settings it gave, and a warning when the fit says the
    machine's speed moved during it (`LatencyFit.warning`); `load`: the 1-minute load average at its end."""
    slo = setup.slo
    line = (f"latency model: held-out MAPE {fit.heldout_mape:.1f}%, mean measured/predicted "
            f"{fit.heldout_mean_ratio:.2f} ({seconds:.0f} s calibration); "
            f"SLO: TPOT {slo.tpot_s * 1000:.1f} ms, TTFT {slo.ttft_s * 1000:.0f} ms; "
            f"max_num_seqs {setup.scheduler.max_num_seqs}, safety margin {setup.safety_margin:.2f} "
            f"(coserve-strict {setup.strict_safety_margin:.2f}), coserve's longest stall {setup.max_stall_ms:.0f} ms; "
            f"load average {load:.1f} on {len(os.sched_getaffinity(0))} cores")
    return line if fit.warning is None else f"{line}\nWARNING: {fit.warning}"
