"""Co-serving: `coserve bench co-serving --quick`'s code (`coserve.bench.coserving.run_benchmark`) on the
device with the main model (bf16 on a GPU): coserve's hybrid policy against temporal sharing, with the engine's
own calibrated latency model and SLOs, a fine-tuning-only run, and the bound on what any policy could
train at each rate (`coserve.bench.headroom`).

The rates, policies, window and fine-tuning lengths are `shapes.Workload`'s (the CPU quick set's rates
would leave a GPU idle); the benchmark's whole JSON is written beside the check's as `coserving.json`.
Reported per rate: each policy's fine-tuning tokens/s and SLO attainment, the hybrid/temporal ratio, the
bound. Checked: every run completed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _gpu_check.context import Context
from _gpu_check.record import PartRecord
from _gpu_check.shapes import MAIN_MODEL

AT_SLO = 0.9  # SLO attainment at which a run counts as keeping the SLO (as `headroom.best_baseline`)


def bench_args(ctx: Context, json_path: Path) -> argparse.Namespace:
    from coserve.bench.coserving import add_arguments

    sizes = ctx.sizes
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--quick", "--json", str(json_path), "--model-dir", str(ctx.models.model(MAIN_MODEL)),
        "--device", ctx.device, "--dtype", sizes.coserving_dtype, "--rates", sizes.coserving_rates,
        "--policies", sizes.coserving_policies, "--window-s", str(sizes.coserving_window_s),
        "--finetune-tokens", sizes.coserving_finetune_tokens])


def _per_rate(result: dict[str, Any]) -> list[dict[str, Any]]:
    bounds = {b["rate"]: b for b in result["headroom"]}
    rows = []
    for rate in result["settings"]["rates"]:
        runs = {r["policy"]: r for r in result["runs"] if r["rate"] == rate}
        ours = runs.get("coserve", {})
        temporal = [r for p, r in runs.items() if p.startswith("temporal")]
        best = max(temporal, key=lambda r: r["finetune_tokens_per_s"], default=None)
        row = {"rate": rate, "coserve_ft_tok_s": ours.get("finetune_tokens_per_s"),
               "coserve_slo": ours.get("slo_attainment"),
               "temporal": None if best is None else best["policy"],
               "temporal_ft_tok_s": None if best is None else best["finetune_tokens_per_s"],
               "temporal_slo": None if best is None else best["slo_attainment"],
               "bound_ft_tok_s": bounds.get(rate, {}).get("finetune_bound_tokens_per_s")}
        if row["temporal_ft_tok_s"]:
            row["hybrid_over_temporal"] = (row["coserve_ft_tok_s"] or 0.0) / row["temporal_ft_tok_s"]
        rows.append(row)
    return rows


def run(ctx: Context, rec: PartRecord) -> None:
    from coserve.bench.coserving import run_benchmark

    json_path = ctx.out_dir / "coserving.json"
    args = bench_args(ctx, json_path)
    result = run_benchmark(args)
    result.pop("_bursty")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    rates, policies = result["settings"]["rates"], result["settings"]["policies"]
    rec.details.update(slo_ms=result["slo"], finetune_only_tokens_per_s=result["finetune_only_tokens_per_s"],
                       latency_model_heldout_mape_percent=result["latency_model"]["heldout_mape_percent"],
                       model=result["model"], per_rate=_per_rate(result), json=str(json_path))
    rec.check("runs completed (rates x policies)", len(result["runs"]), f"== {len(rates) * len(policies)}",
              len(result["runs"]) == len(rates) * len(policies))
    rec.check("TPOT / TTFT SLO ms (calibrated)", [round(result["slo"]["tpot_ms"], 1), round(result["slo"]["ttft_ms"])])
    rec.check("fine-tuning alone, trained tok/s", result["finetune_only_tokens_per_s"])
    lines = []
    for row in rec.details["per_rate"]:
        kept = [f"{p} SLO {s if s is None else round(s, 2)}" for p, s in
                (("coserve", row["coserve_slo"]), (row["temporal"], row["temporal_slo"]))]
        rec.check(f"rate {row['rate']}: fine-tuning tok/s coserve / {row['temporal']} / bound",
                  [_round(row["coserve_ft_tok_s"]), _round(row["temporal_ft_tok_s"]), _round(row["bound_ft_tok_s"])],
                  ", ".join(kept) + f" (keeps the SLO at >= {AT_SLO})")
        ratio = row.get("hybrid_over_temporal")
        lines.append(f"rate {row['rate']}: hybrid/temporal " + ("-" if ratio is None else f"{ratio:.2f}x"))
    rec.summary = "; ".join(lines)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
