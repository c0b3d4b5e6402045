"""The GPU projection's JSON as markdown: per model and GPU, each policy's fine-tuning at each rate, then
coserve against the best baseline, the bound and FlexLLM's separate-GPU split (`gpu_projection`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _policy_table(scenario: dict[str, Any], policies: Sequence[str]) -> list[str]:
    """Rate x policy: fine-tuning tok/s (SLO attainment)."""
    lines = ["| req/s | inference compute | " + " | ".join(policies) + " | bound |",
             "|---" * (len(policies) + 3) + "|"]
    for summary in scenario["rates"]:
        rate = summary["rate"]
        cells = []
        for policy in policies:
            row = next((r for r in scenario["runs"] if r["rate"] == rate and r["policy"] == policy), None)
            cells.append("-" if row is None else
                         f"{_num(row['finetune_tokens_per_s'])} ({_num(row['slo_attainment'], 2)})")
        lines.append(f"| {rate:g} | {100 * summary['inference_compute_share']:.0f}% | " + " | ".join(cells)
                     + f" | {_num(summary['bound_tokens_per_s'])} |")
    return lines


def _ours(summary: dict[str, Any], policy: str, key: str, min_attainment: float) -> str:
    """One of ours' ratios, marked † when that run missed the SLO (attainment under `min_attainment`)."""
    ours = summary.get(policy) or {}
    missed = (ours.get("slo_attainment") or 0.0) < min_attainment
    return _num(ours.get(key), 2) + (" †" if ours and missed else "")


def _ratio_table(scenario: dict[str, Any], min_attainment: float) -> list[str]:
    """Rate: the best baseline, and coserve / coserve-strict against it, the bound and the 75/25 split."""
    lines = ["| req/s | best baseline (tok/s) | coserve / best | coserve / bound | coserve-strict / best | "
             "coserve-strict / bound | coserve / split 75-25 | FLOPs used: coserve, strict, best |", "|---" * 8 + "|"]
    for s in scenario["rates"]:
        best = "none keeps the SLO" if s["best_baseline"] is None else \
            f"{s['best_baseline']} ({_num(s['best_baseline_tokens_per_s'])})"
        used = ", ".join(_num(_compute(scenario, s["rate"], p), 2)
                         for p in ("coserve", "coserve-strict", s["best_baseline"]))
        cells = [_ours(s, policy, key, min_attainment) for policy, key in
                 (("coserve", "vs_best_baseline"), ("coserve", "vs_bound"), ("coserve-strict", "vs_best_baseline"),
                  ("coserve-strict", "vs_bound"), ("coserve", "vs_split_75_25"))]
        lines.append(f"| {s['rate']:g} | {best} | " + " | ".join(cells) + f" | {used} |")
    return lines


def _compute(scenario: dict[str, Any], rate: float, policy: str | None) -> float | None:
    """The share of the window's reachable FLOPs `policy`'s run at `rate` used (None: no such run)."""
    row = next((r for r in scenario["runs"] if r["rate"] == rate and r["policy"] == policy), None)
    return None if row is None else float(row["window_split"]["compute"])


def _heading(scenario: dict[str, Any]) -> list[str]:
    facts, cal = scenario["roofline"], scenario["calibration"]
    decode = facts["decode_ms"]
    return [f"### {scenario['model']} on one {scenario['gpu']}", "",
            f"Roofline: ridge {facts['ridge_rows']:.0f} rows; a decode iteration at a 512-token context takes "
            f"{decode['1']:.1f} ms at batch 1, {decode['32']:.1f} ms at 32, {decode['128']:.1f} ms at 128. "
            f"Fine-tuning alone: {_num(scenario['finetune_alone_tokens_per_s'])} trained tok/s "
            f"({_num(scenario['finetune_compute_tokens_per_s'])} with no time but its FLOPs). coserve's linear "
            f"latency model, calibrated on the simulated GPU: held-out MAPE {cal['heldout_mape_percent']:.1f}%, "
            f"margins {cal['safety_margin']:.2f} (strict {cal['strict_safety_margin']:.2f}).", ""]


def render_markdown(result: dict[str, Any]) -> str:
    """Tables per scenario (fine-tuning tok/s with SLO attainment in brackets; ratios)."""
    meta = result["meta"]
    lines = [f"`{meta['command']}` ({meta['date']}; {meta['note']}). SLO: TPOT {meta['slo']['tpot_ms']:g} ms, "
             f"TTFT {meta['slo']['ttft_ms']:g} ms; {meta['window_s']:g} s windows. Cells: fine-tuning trained "
             f"tok/s (SLO attainment); † marks a ratio of ours whose run kept the SLO for under "
             f"{100 * meta['min_attainment']:.0f}% of requests.", ""]
    for scenario in result["scenarios"]:
        lines += _heading(scenario) + _policy_table(scenario, meta["policies"]) + [""]
        lines += _ratio_table(scenario, meta["min_attainment"]) + [""]
    return "\n".join(lines)
