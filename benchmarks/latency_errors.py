"""Where the latency model's error comes from: iteration kinds, features, the machine's noise vs misfit.

Runs `coserve profile`'s sweep (same settings, same seeded fit / held-out split, so its held-out MAPE is
the one `coserve profile` prints) but keeps every run of every scenario, then reports:

- **held-out MAPE** as `coserve profile` computes it, and a 5-fold cross-validated MAPE over all
  iterations (every iteration predicted by a model not fitted on it: per-kind numbers with more samples);
- **by iteration kind** (decodes only, with a prefill chunk, with a forward window, with backward
  tasklets, fine-tuning alone): cross-validated MAPE and the mean signed error (bias: the model's
  systematic miss on that kind; noise averages out, misfit does not);
- **noise**: the spread of a scenario's runs, |run1 - run2| / min, which no model of the features can
  predict (the fit uses each scenario's fastest run, which is less noisy than one run, not noise-free);
- **residuals against each feature** (Spearman rank correlation of the signed relative error with the
  feature): a misfit the features' linear costs cannot express shows as a correlation.

Fine-tuning's attention is not a feature: a forward window of n tokens at position p computes
n * p + n (n + 1) / 2 (query, key) pairs, and a backward tasklet recomputes as many per layer. The
script records those pairs per iteration (`ft_attention_pairs`) and reports the residuals' correlation
with them and the cross-validated MAPE of a least-squares fit with and without them as a column.

`--clock cpu` (a diagnostic, with OMP_NUM_THREADS=1 so that all of an iteration's compute runs on the
thread that steps the engine) times each iteration by that thread's CPU time instead of the wall clock:
on a shared machine this removes the time the thread waited for a core, so what error is left is the
model's misfit (and the CPU's own variation), not the neighbours' load.

usage: .venv/bin/python benchmarks/latency_errors.py --model DIR [--iterations 120] [--repeats 2]
       [--json OUT]   (other options as `coserve profile`)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KINDS = ("decodes only", "prefill chunk", "forward window", "backward tasklets", "fine-tuning alone")


def kind(features: Any) -> str:
    """The iteration's kind, by the work it holds (fine-tuning first: it dominates the iteration)."""
    inference = features.decode_tokens or features.prefill_tokens
    if (features.ft_forward_tokens or features.ft_backward_token_layers) and not inference:
        return "fine-tuning alone"
    if features.ft_backward_token_layers:
        return "backward tasklets"
    if features.ft_forward_tokens:
        return "forward window"
    return "prefill chunk" if features.prefill_tokens else "decodes only"


def cross_validated(samples: list[tuple[Any, float]], fingerprint: Any, folds: int, seed: int) -> list[float]:
    """Each sample's prediction by a model fitted on the other folds."""
    from coserve.planner.latency import LatencyModel

    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    predicted = [0.0] * len(samples)
    for k in range(folds):
        test = set(order[k::folds])
        model = LatencyModel(fingerprint)
        model.fit([s for i, s in enumerate(samples) if i not in test])
        for i in test:
            predicted[i] = model.predict(samples[i][0])
    return predicted


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out
    rx, ry = ranks(xs), ranks(ys)
    if len(set(rx)) < 2 or statistics.pstdev(rx) == 0 or statistics.pstdev(ry) == 0:
        return 0.0
    return statistics.correlation(rx, ry)


def analyse(runs: list[list[tuple[tuple[Any, float], bool]]], fingerprint: Any, settings: Any,
            pairs_by_time: dict[float, int]) -> dict[str, Any]:
    from coserve.bench.profiler import fit_report
    from coserve.planner.latency_features import FEATURE_NAMES

    fastest = [min(r, key=lambda run: run[0][1]) for r in runs]
    report = fit_report(fastest, fingerprint, settings)
    samples = [s for s, optimizer in fastest if not optimizer]
    noise = {s[0]: [] for s in samples}  # features (frozen, hashable) -> spreads
    for r in runs:
        times = sorted(run[0][1] for run in r if not run[1])
        if len(times) >= 2:
            noise.setdefault(r[0][0][0], []).append((times[1] - times[0]) / times[0])
    predicted = cross_validated(samples, fingerprint, 5, settings.seed + 3)
    rel = [(p - t) / t for (_, t), p in zip(samples, predicted)]  # signed: > 0 over-predicts
    by_kind: dict[str, Any] = {}
    for name in KINDS:
        idx = [i for i, (f, _) in enumerate(samples) if kind(f) == name]
        if not idx:
            continue
        spreads = [x for i in idx for x in noise.get(samples[i][0], [])]
        by_kind[name] = {
            "iterations": len(idx),
            "median_ms": 1000 * statistics.median(samples[i][1] for i in idx),
            "cv_mape_percent": 100 * statistics.fmean(abs(rel[i]) for i in idx),
            "bias_percent": 100 * statistics.fmean(rel[i] for i in idx),
            "repeat_spread_percent": 100 * statistics.median(spreads) if spreads else None,
        }
    vectors = [f.vector() for f, _ in samples]
    correlation = {name: spearman([v[j] for v in vectors], rel) for j, name in enumerate(FEATURE_NAMES)
                   if len({v[j] for v in vectors}) > 1}
    pairs = [float(pairs_by_time.get(t, 0)) for _, t in samples]
    correlation["ft_attention_pairs (not a feature)"] = spearman(pairs, rel)
    base_rows = [[1.0, *v] for v in vectors]
    times = [t for _, t in samples]
    with_pairs = {"features only": relative_ls_cv(base_rows, times, 5, settings.seed + 3),
                  "features + ft_attention_pairs": relative_ls_cv([r + [p] for r, p in zip(base_rows, pairs)],
                                                                  times, 5, settings.seed + 3)}
    all_spreads = [x for xs in noise.values() for x in xs]
    return {
        "heldout_mape_percent": report.heldout_mape, "fit_mape_percent": report.train_mape,
        "cv_mape_percent": 100 * statistics.fmean(abs(x) for x in rel),
        "repeat_spread_percent_median": 100 * statistics.median(all_spreads) if all_spreads else None,
        "by_kind": by_kind, "residual_rank_correlation": correlation,
        "least_squares_cv_mape_percent": with_pairs,
        "coefficients": report.model.coefficients,
        "samples": [{"features": dict(zip(FEATURE_NAMES, f.vector())), "seconds": t, "kind": kind(f),
                     "cv_predicted": p, "ft_attention_pairs": q} for (f, t), p, q in zip(samples, predicted, pairs)],
    }


def ft_attention_pairs(plan: Any) -> int:
    """(query, key) pairs of the plan's fine-tuning attention: forward windows, and backward tasklets
    once per layer they recompute."""
    def pairs(start: int, n: int) -> int:
        return n * start + n * (n + 1) // 2
    training = plan.training
    return (sum(pairs(w.start, w.num_tokens) for w in training.forward_windows)
            + sum(pairs(t.start, t.end - t.start) * (t.layer_end - t.layer_start) for t in training.backward_tasklets))


def instrument(engine: Any, cpu_clock: bool) -> dict[float, int]:
    """Wrap `engine.step`: record each iteration's fine-tuning attention pairs under its measured time
    (the key the sweep's samples carry), and with `cpu_clock` report the stepping thread's CPU time
    as the iteration's total time."""
    step, pairs_by_time = engine.step, {}

    def timed(plan: Any) -> Any:
        start = time.thread_time()
        result = step(plan)
        if cpu_clock:
            result.timings.total_s = time.thread_time() - start
        pairs_by_time[result.timings.total_s] = ft_attention_pairs(plan)
        return result

    engine.step = timed
    return pairs_by_time


def relative_ls_cv(rows: list[list[float]], times: list[float], folds: int, seed: int) -> float:
    """Cross-validated MAPE (percent) of a plain least-squares fit on relative error (no sign
    constraint): the comparison of two feature sets, not the production fit."""
    import numpy as np

    x, y = np.array(rows, dtype=float), np.array(times, dtype=float)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    order = list(range(len(y)))
    random.Random(seed).shuffle(order)
    errors = np.zeros(len(y))
    for k in range(folds):
        test = np.array(order[k::folds])
        train = np.setdiff1d(np.arange(len(y)), test)
        a = x[train] / scale / y[train, None]
        theta = np.linalg.lstsq(a, np.ones(len(train)), rcond=None)[0] / scale
        errors[test] = np.abs(x[test] @ theta - y[test]) / y[test]
    return float(100 * errors.mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time iterations by the wall clock (as the server does) or by the stepping "
                             "thread's CPU time (a diagnostic; use OMP_NUM_THREADS=1)")
    args = parser.parse_args()
    from coserve.bench.profiler import SweepSettings, scenario_runs
    from coserve.contract.engine_config import EngineConfig
    from coserve.model.tiny_model import create_random_adapter
    from coserve.planner.latency import ModelFingerprint, machine_id, model_id_from_config
    from coserve.torch_engine.engine import TorchEngine

    contexts = tuple(c for c in (16, 128, 512, 2048) if c <= args.max_context)
    settings = SweepSettings(iterations=args.iterations, seed=args.seed, contexts=contexts, repeats=args.repeats)
    tokens = max(settings.decodes) * (max(contexts) + 1) + 512 + settings.finetune_length + 1024
    engine = TorchEngine(EngineConfig(model=args.model, dtype=args.dtype, num_kv_blocks=tokens // 16 + 1, block_size=16,
                                 max_loras=args.adapters + 1, max_lora_rank=16, seed=args.seed))
    config = json.loads((Path(args.model) / "config.json").read_text(encoding="utf-8"))
    fingerprint = ModelFingerprint(model_id_from_config(config), machine_id("cpu"),
                                   str(engine.dtype).removeprefix("torch."))
    pairs_by_time = instrument(engine, args.clock == "cpu")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [str(create_random_adapter(args.model, Path(tmp) / f"a{i}", seed=i, r=8, lora_alpha=16,
                                              target_modules=["q_proj", "v_proj"])) for i in range(args.adapters)]
        runs = scenario_runs(engine, adapters, settings)
    result = analyse(runs, fingerprint, settings, pairs_by_time)
    result["sweep_seconds"] = time.monotonic() - start
    result["clock"] = args.clock
    print(f"held-out MAPE {result['heldout_mape_percent']:.1f}% (fit {result['fit_mape_percent']:.1f}%), "
          f"5-fold CV MAPE {result['cv_mape_percent']:.1f}%, repeat spread median "
          f"{result['repeat_spread_percent_median']:.1f}%; sweep {result['sweep_seconds']:.0f} s")
    print(f"{'kind':>18} {'n':>4} {'median ms':>9} {'CV MAPE':>8} {'bias':>7} {'spread':>7}")
    for name, row in result["by_kind"].items():
        spread = "-" if row["repeat_spread_percent"] is None else f"{row['repeat_spread_percent']:.1f}%"
        print(f"{name:>18} {row['iterations']:>4} {row['median_ms']:>9.1f} {row['cv_mape_percent']:>7.1f}% "
              f"{row['bias_percent']:>+6.1f}% {spread:>7}")
    print("residual rank correlation:", ", ".join(f"{k} {v:+.2f}" for k, v in
                                                  result["residual_rank_correlation"].items()))
    print("least-squares CV MAPE:", ", ".join(f"{k} {v:.1f}%" for k, v in
                                              result["least_squares_cv_mape_percent"].items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
