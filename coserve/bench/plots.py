"""PNG plots of a co-serving benchmark (matplotlib, headless).

* ``slo_attainment.png``, ``inference_throughput.png``, ``finetune_throughput.png``: one line per
  policy against the arrival rate (FlexLLM Figures 10-11's shape); the fine-tuning plot also draws the
  fine-tuning-only throughput as a dashed line and `headroom`'s bound for any policy as a dotted one.
* ``bursty_timeline.png``: under the bursty trace, inference and fine-tuning tokens per iteration
  (one point per iteration, smoothed over 1 s) with the arrival rate on a second axis (FlexLLM
  Figure 12's shape). Fine-tuning tokens are forward-window tokens plus backward token-layers / layers
  (a full-depth backward of one token counts one).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from coserve.bench.replay import RunRecord


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _by_policy(runs: list[dict[str, Any]], key: str) -> dict[str, tuple[list[float], list[float]]]:
    lines: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for run in sorted(runs, key=lambda r: r["rate"]):
        if run[key] is not None:
            lines[run["policy"]][0].append(run["rate"])
            lines[run["policy"]][1].append(run[key])
    return dict(lines)


def _rate_plot(result: dict[str, Any], key: str, ylabel: str, path: Path,
               reference: float | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, (xs, ys) in _by_policy(result["runs"], key).items():
        ax.plot(xs, ys, marker="o", label=policy, linewidth=2.5 if policy == "coserve" else 1.2)
    if reference is not None:
        ax.axhline(reference, linestyle="--", color="gray", label="fine-tuning only")
        bounds = sorted(result.get("headroom", []), key=lambda b: b["rate"])
        if bounds:
            ax.plot([b["rate"] for b in bounds], [b["finetune_bound_tokens_per_s"] for b in bounds],
                    linestyle=":", color="black", label="bound for any policy (headroom)")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{ylabel} (TPOT SLO {result['slo']['tpot_ms']:.0f} ms, "
                 f"TTFT SLO {result['slo']['ttft_ms']:.0f} ms)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_series(run: RunRecord, bin_s: float = 1.0) -> dict[str, list[float]]:
    """Per-second bins of the run: arrivals/s, inference tokens and fine-tuning tokens per iteration."""
    num_bins = max(1, int(run.ended_s / bin_s) + 1)
    arrivals = [0.0] * num_bins
    for r in run.requests:
        arrivals[min(num_bins - 1, int(r.arrival_s / bin_s))] += 1.0 / bin_s
    inference, finetune, count = [0.0] * num_bins, [0.0] * num_bins, [0] * num_bins
    for it in run.iterations:
        b = min(num_bins - 1, int(it.start_s / bin_s))
        f = it.features
        inference[b] += it.inference_tokens
        finetune[b] += f.ft_forward_tokens + f.ft_backward_token_layers / run.num_layers
        count[b] += 1
    per_it = [(i / c if c else 0.0, t / c if c else 0.0) for i, t, c in zip(inference, finetune, count)]
    return {"time_s": [b * bin_s for b in range(num_bins)], "arrivals_per_s": arrivals,
            "inference_tokens_per_iteration": [p[0] for p in per_it],
            "finetune_tokens_per_iteration": [p[1] for p in per_it]}


def _timeline_plot(run: RunRecord, path: Path) -> Path:
    plt = _pyplot()
    series = timeline_series(run)
    fig, ax = plt.subplots(figsize=(7, 4))
    t = series["time_s"]
    ax.stackplot(t, series["inference_tokens_per_iteration"], series["finetune_tokens_per_iteration"],
                 labels=["inference tokens / iteration", "fine-tuning tokens / iteration"], alpha=0.7)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens per iteration (1 s bins)")
    rate_ax = ax.twinx()
    rate_ax.plot(t, series["arrivals_per_s"], color="black", linewidth=1.2, label="arrivals/s")
    rate_ax.set_ylabel("arrival rate (requests/s)")
    handles = ax.get_legend_handles_labels()[0] + rate_ax.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper right")
    ax.set_title(f"{run.policy} under a bursty trace (mean {run.rate} req/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], bursty: RunRecord | None, folder: Path) -> list[Path]:
    """Write every plot of the module docstring into `folder`; returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [
        _rate_plot(result, "slo_attainment", "SLO attainment", folder / "slo_attainment.png"),
        _rate_plot(result, "inference_tokens_per_s", "inference tokens/s",
                   folder / "inference_throughput.png"),
        _rate_plot(result, "finetune_tokens_per_s", "fine-tuning trained tokens/s",
                   folder / "finetune_throughput.png", reference=result.get("finetune_only_tokens_per_s")),
    ]
    if bursty is not None:
        paths.append(_timeline_plot(bursty, folder / "bursty_timeline.png"))
    return paths
