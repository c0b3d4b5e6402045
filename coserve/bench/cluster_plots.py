"""PNG plots of the cluster benchmarks (matplotlib, headless; `plots._pyplot`).

* ``cluster_validation.png`` (`cluster validate`): per run (engines x rate) and metric, the measured
  value next to the simulated one (and the one predicted from the 1-engine run), as bars.
* ``cluster_projection_<model>.png`` (`cluster project`): against the number of engines, SLO attainment
  and fine-tuning tokens/s per engine (left), and the central scheduler's utilization and the share of
  engine time spent waiting for it, per cost model (right).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coserve.bench.plots import _pyplot

_VALIDATED = (("inference_tokens_per_s", "inference tok/s"), ("finetune_tokens_per_s", "fine-tuning tok/s"),
              ("slo_attainment", "SLO attainment"))


def validation_plot(result: dict[str, Any], folder: Path) -> Path:
    """Measured vs simulated (vs predicted) per run and metric."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    fig, axes = plt.subplots(1, len(_VALIDATED), figsize=(4 * len(_VALIDATED), 3.6))
    for ax, (key, label) in zip(axes, _VALIDATED):
        names = [f"{r['engines']}e @{r['rate_per_engine']:g}/s" for r in runs]
        series = {"measured": [r["simulated"][key]["measured"] or 0.0 for r in runs],
                  "simulated": [r["simulated"][key]["simulated"] or 0.0 for r in runs],
                  "predicted from 1 engine": [r.get("predicted_from_1_engine", {}).get(key, {}).get("simulated")
                                              or 0.0 for r in runs]}
        width = 0.27
        for k, (name, values) in enumerate(series.items()):
            ax.bar([i + (k - 1) * width for i in range(len(runs))], values, width, label=name)
        ax.set_xticks(range(len(runs)), names, fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"cluster simulator vs measured runs ({result['machine']})", fontsize=9)
    fig.tight_layout()
    path = folder / "cluster_validation.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def projection_plots(result: dict[str, Any], folder: Path) -> list[Path]:
    """Attainment and fine-tuning per engine, and the scheduler's load, against the engine count."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    costs = sorted({r["cost"] for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ft_ax = left.twinx()
    for cost in costs:
        mine = sorted((r for r in rows if r["cost"] == cost), key=lambda r: r["engines"])
        engines = [r["engines"] for r in mine]
        left.plot(engines, [r["slo_attainment"] for r in mine], marker="o", label=f"SLO attainment ({cost})")
        ft_ax.plot(engines, [r["finetune_tokens_per_s"] / r["engines"] for r in mine], marker="s",
                   linestyle="--", label=f"fine-tuning tok/s per engine ({cost})")
        right.plot(engines, [r["scheduler_utilization"] for r in mine], marker="o",
                   label=f"scheduler utilization ({cost})")
        right.plot(engines, [r["engine_wait_fraction"] for r in mine], marker="x", linestyle=":",
                   label=f"engine time waiting for it ({cost})")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("engines")
        ax.grid(alpha=0.3)
    left.set_ylim(0, 1.05)
    ft_ax.set_ylim(bottom=0)
    left.set_ylabel("SLO attainment")
    ft_ax.set_ylabel("fine-tuning tokens/s per engine")
    handles = left.get_legend_handles_labels()[0] + ft_ax.get_legend_handles_labels()[0]
    left.legend(handles, [h.get_label() for h in handles], fontsize=6, loc="lower left")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set_ylabel("fraction")
    right.legend(fontsize=6)
    fig.suptitle(f"{result['engine_model']} engines, {result['tenants']} tenants, "
                 f"{result['rate_per_engine']:g} requests/s per engine", fontsize=9)
    fig.tight_layout()
    path = folder / f"cluster_projection_{result['engine_model']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
