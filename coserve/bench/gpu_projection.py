"""`coserve bench gpu-projection`: the co-serving benchmark's policies on a simulated A100 or H100.

    coserve bench gpu-projection [--models 1b,8b] [--gpus a100,h100] [--window-s 60] [--json OUT]

No GPU has run coserve yet; this projects the co-serving benchmark (`coserve bench co-serving`) into the GPU
regime with the simulator, whose policies are the real ones (it reproduced measured CPU runs within ~8%,
`simulator_check`). What changes is the engine: iterations take `roofline.RooflineModel`'s time, built
from published hardware figures (see that module for every figure, source and piece of arithmetic). For
each model (Llama-3.2-1B, Llama-3.1-8B) and GPU (A100-80GB, H100-80GB):

1. Calibration as the benchmark does it, against the simulated GPU (`gpu_calibration`): the profiling
   sweep and a 6 s co-serving warm-up fit coserve's linear latency model and its safety margins; every
   policy plans with a copy and refines it online.
2. Fine-tuning alone (coserve with no requests) for `window_s`.
3. Per rate, a Poisson trace replayed once per policy (`POLICIES`): SLO attainment, fine-tuning tok/s.
4. Per rate, the bound: what any policy could train while serving that trace (`finetune_bound`, charged the
   inference compute of the runs that kept the SLO, `served_inference_s`); runs that missed the SLO served
   less inference and may train past it.

What the projection assumes (besides the roofline's figures):

* SLOs: FlexLLM's for Llama-3.1-8B (§8: 50 ms TPOT, 5 s TTFT), judged as the benchmark does (the share of
  requests whose TTFT and mean TPOT are both within them). No paper gives a 1B SLO; the same is used.
* Requests: Poisson arrivals (the papers replay bursty Azure / BurstGPT traces), one tenant, base model,
  ShareGPT lengths at full scale (means 161 / 338 tokens, `traces.sharegpt_lengths`, clipped to 2048 /
  1024). Rates are per GPU: FlexLLM's 8B runs span 4-20 req/s over 4 A100s (1-5 per GPU); the sets below
  go on until inference takes most of the GPU.
* The job: one LoRA job of synthetic sequences of 1024-4096 tokens (a third untrained), batch 1, forward
  windows up to 1024 tokens (FlexLLM trains on Sky-T1 sequences of up to 8192).
* Engine limits: 256 running sequences (vLLM V0's default `max_num_seqs`), 2048 tokens an iteration (chunked
  prefill; also the largest forward window a temporal baseline's turn holds), 8192 backward token-layers
  an iteration (coserve's default), 16384 KV blocks of 16 tokens (less than an 80 GB GPU holds beside the
  weights, and more than these traces use).
* Baselines: temporal sharing at n = 1, 2, 4, 16, 128 (FlexLLM sweeps 64-512; with 10-20 ms decode steps
  and a 50 ms TPOT the SLO leaves room for a fine-tuning turn every few iterations, so the small n are
  the tuned ones here), dynamic temporal sharing, static splits of 10%, 20% and 40%. The best baseline at
  a rate is the one that trains most while keeping SLO attainment >= 0.9: each rate gets its best-tuned
  baseline, which favours the baselines.
* FlexLLM's 1.9-4.8x is against separate GPUs (75% vLLM, 25% LlamaFactory). `split_75_25` is that
  reference for one GPU's worth, computed, not simulated: a quarter of fine-tuning alone per GPU, which
  needs three GPUs to serve four GPUs' rate within the SLO (not checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coserve.bench.gpu_calibration import calibrate_on_roofline
from coserve.bench.gpu_report import render_markdown
from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits, RunRecord
from coserve.bench.roofline import GPUS, MODELS, ModelSpec, RooflineModel
from coserve.bench.run_metrics import SLO, summarize
from coserve.bench.simulator import EngineShape, simulate
from coserve.bench.traces import make_trace, poisson_arrivals, sharegpt_lengths, synthetic_training_examples
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel, ModelFingerprint, machine_id
from coserve.planner.latency_features import PlanFeatures

SLO_FLEXLLM = SLO(ttft_s=5.0, tpot_s=0.050)
POLICIES = ("coserve", "coserve-strict", "temporal-n1", "temporal-n2", "temporal-n4", "temporal-n16", "temporal-n128",
            "dynamic-temporal", "static-split-0.1", "static-split-0.2", "static-split-0.4")
OURS = ("coserve", "coserve-strict")
RATES = {"1b": (5.0, 10.0, 20.0, 40.0, 60.0), "8b": (1.0, 2.5, 5.0, 10.0, 20.0)}
SCHEDULER = SchedulerConfig(max_model_len=8192, max_num_seqs=256, max_batch_tokens=2048, block_size=16)
NUM_KV_BLOCKS = 16384
LENGTHS = sharegpt_lengths(scale=1.0, prompt_range=(4, 2048), output_range=(2, 1024))
FINETUNE_TOKENS = (1024, 4096)
MIN_ATTAINMENT = 0.9


@dataclass(frozen=True, slots=True)
class ProjectionSettings:
    """What every scenario shares."""

    window_s: float = 60.0
    policies: tuple[str, ...] = POLICIES
    slo: SLO = SLO_FLEXLLM
    seed: int = 0
    stall_multiple: float = 3.0  # coserve's longest stall, in TPOT SLOs (the benchmark's default)
    finetune_tokens: tuple[int, int] = FINETUNE_TOKENS


def engine_shape(model: ModelSpec) -> EngineShape:
    return EngineShape(NUM_KV_BLOCKS, SCHEDULER.block_size, 4, model.vocab_size, model.num_layers)


def job_spec(model: ModelSpec, settings: ProjectionSettings, job_id: str = "gpu-projection") -> FinetuneJobSpec:
    low, high = settings.finetune_tokens
    examples = synthetic_training_examples(64, seed=settings.seed, vocab_size=model.vocab_size,
                                           min_tokens=low, max_tokens=high)
    return FinetuneJobSpec(job_id=job_id, tenant="finetune", adapter_id=2**41, examples=examples, n_epochs=1000,
                           batch_size=1, seed=settings.seed, num_layers=model.num_layers,
                           output_dir=f"/sim/{job_id}", max_window_tokens=1024)


def inference_compute_s(run: RunRecord, roofline: RooflineModel) -> float:
    """Seconds of the inference FLOPs of the iterations that started within the window, at the GPU's
    reachable rate: the least time any schedule spends on that inference (see `finetune_bound`)."""
    flops = sum(roofline.inference_flops(it.features) for it in run.iterations if it.start_s < run.window_s)
    return flops / roofline.gpu.flops_per_s


def window_split(run: RunRecord, roofline: RooflineModel) -> dict[str, float]:
    """Where the window went: the share of it in iterations of each kind (inference alone, inference with
    forward windows, inference with backward tasklets, fine-tuning alone), and `compute`, the share of the
    window's reachable FLOPs the iterations used (1.0: compute-bound throughout)."""
    split = {"inference": 0.0, "inference+forward": 0.0, "inference+backward": 0.0, "finetune": 0.0, "compute": 0.0}
    for it in run.iterations:
        if it.start_s >= run.window_s or not it.has_work:
            continue
        f, seconds = it.features, it.end_s - it.start_s
        kind = "finetune" if not f.num_sequences else \
            "inference+backward" if f.ft_backward_token_layers else \
            "inference+forward" if f.ft_forward_tokens else "inference"
        split[kind] += seconds / run.window_s
        split["compute"] += roofline.compute_s(f) / run.window_s
    return split


def finetune_compute_rate(alone: RunRecord, roofline: RooflineModel) -> float:
    """Trained tokens per second of fine-tuning FLOPs (at the reachable rate), from a fine-tuning-only run:
    the trained tokens of its completed steps over the FLOPs of the iterations up to the last of them."""
    last = max((it.end_s for it in alone.iterations if it.trained_tokens), default=None)
    if last is None:
        raise ValueError("the fine-tuning-only run completed no step: lengthen --window-s")
    trained = sum(it.trained_tokens for it in alone.iterations if it.end_s <= last)
    flops = sum(roofline.finetune_flops(it.features) for it in alone.iterations if it.end_s <= last)
    return trained / (flops / roofline.gpu.flops_per_s)


def finetune_bound(compute_rate: float, inference_s: float, window_s: float) -> float:
    """The most any policy can train in the window while serving inference of `inference_s` FLOP-seconds.

    Under the roofline every iteration lasts at least its FLOPs at the reachable rate (``max(M, C) >= C``),
    however inference and fine-tuning are batched, so inference and fine-tuning FLOPs together fit in the
    window, and each trained token needs a fixed amount of fine-tuning FLOPs (``1 / compute_rate``s).
    Generous: it charges no per-iteration constant and no memory-bound time at all."""
    return compute_rate * max(0.0, window_s - inference_s) / window_s


def _run(setup: PolicySetup, policy: str, rate: float, roofline: RooflineModel, spec: FinetuneJobSpec,
         settings: ProjectionSettings) -> RunRecord:
    """One simulated run of `policy` at `rate` (no trace at rate 0: fine-tuning alone for the window)."""
    trace = make_trace(poisson_arrivals(rate, settings.window_s, settings.seed), settings.seed,
                       lengths=LENGTHS) if rate else []
    limits = RunLimits(settings.window_s, settings.slo.ttft_s if rate else 0.0)
    job = dataclasses.replace(spec, job_id=f"{policy}-{rate}", output_dir=f"/sim/{policy}-{rate}")
    return simulate(make_factory(policy, setup), trace, limits, roofline, engine_shape(roofline.model),
                    job_spec=job, policy_name=policy, rate=rate)


def best_baseline(rows: Sequence[dict[str, Any]], rate: float) -> tuple[str, float] | None:
    """The baseline training most at `rate` while keeping SLO attainment >= `MIN_ATTAINMENT`."""
    kept = [(row["finetune_tokens_per_s"], row["policy"]) for row in rows
            if row["rate"] == rate and row["policy"] not in OURS
            and (row["slo_attainment"] or 0.0) >= MIN_ATTAINMENT]
    return (max(kept)[1], max(kept)[0]) if kept else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def rate_summary(rows: Sequence[dict[str, Any]], rate: float, bound: float, inference_share: float,
                 finetune_alone: float) -> dict[str, Any]:
    """One rate's comparison: each of ours against the best baseline, the bound and FlexLLM's split."""
    best = best_baseline(rows, rate)
    summary: dict[str, Any] = {"rate": rate, "inference_compute_share": inference_share,
                               "bound_tokens_per_s": bound, "split_75_25_tokens_per_s": finetune_alone / 4.0,
                               "best_baseline": None if best is None else best[0],
                               "best_baseline_tokens_per_s": None if best is None else best[1]}
    for row in rows:
        if row["rate"] == rate and row["policy"] in OURS:
            ours, name = row["finetune_tokens_per_s"], row["policy"]
            summary[name] = {"finetune_tokens_per_s": ours, "slo_attainment": row["slo_attainment"],
                             "vs_best_baseline": _ratio(ours, None if best is None else best[1]),
                             "vs_bound": _ratio(ours, bound), "vs_split_75_25": _ratio(ours, finetune_alone / 4.0)}
    return summary


def _print_row(row: dict[str, Any]) -> None:
    att = row["slo_attainment"]
    print(f"  {row['policy']:>17} rate {row['rate']:<5g} SLO {'-' if att is None else f'{att:.3f}'}  fine-tuning "
          f"{row['finetune_tokens_per_s']:8.0f} tok/s  inference {row['inference_tokens_per_s']:8.0f} tok/s  "
          f"TPOT p50 {row['tpot_p50_ms'] or 0:5.1f} ms  TTFT p99 {row['ttft_p99_ms'] or 0:6.0f} ms  FLOPs used "
          f"{row['window_split']['compute']:.2f}", flush=True)


def served_inference_s(rows: Sequence[dict[str, Any]]) -> float:
    """The inference compute the bound charges at a rate: the least of the runs that kept SLO attainment >=
    `MIN_ATTAINMENT` (they served the trace; a run that missed it served less and is not what the bound is
    about), or of all the runs when none did."""
    kept = [row["inference_compute_s"] for row in rows if (row["slo_attainment"] or 0.0) >= MIN_ATTAINMENT]
    return float(min(kept or [row["inference_compute_s"] for row in rows]))


def _measure_rate(setup: PolicySetup, roofline: RooflineModel, spec: FinetuneJobSpec, rate: float,
                  settings: ProjectionSettings) -> list[dict[str, Any]]:
    """Every policy at `rate`: its metrics rows, with its inference compute and `window_split`."""
    rows = []
    for policy in settings.policies:
        run = _run(setup, policy, rate, roofline, spec, settings)
        rows.append({**summarize(run, settings.slo).to_dict(),
                     "inference_compute_s": inference_compute_s(run, roofline),
                     "window_split": window_split(run, roofline)})
        _print_row(rows[-1])
    return rows


def project_scenario(model_key: str, gpu_key: str, rates: Sequence[float],
                     settings: ProjectionSettings) -> dict[str, Any]:
    """Calibration, fine-tuning alone, every policy at every rate, and the bounds, for one model and GPU."""
    model, gpu = MODELS[model_key], GPUS[gpu_key]
    roofline, spec = RooflineModel(model, gpu), job_spec(model, settings)
    setup, fit, overrun = calibrate_on_roofline(roofline, engine_shape(model), SCHEDULER, settings.slo, spec,
                                                rates[len(rates) // 2], LENGTHS, seed=settings.seed,
                                                stall_multiple=settings.stall_multiple)
    print(f"{model.name} on {gpu.name}: ridge {roofline.ridge_rows():.0f} rows; latency model held-out MAPE "
          f"{fit.heldout_mape:.1f}%, margins {setup.safety_margin:.2f} / strict {setup.strict_safety_margin:.2f}",
          flush=True)
    alone_run = _run(setup, "coserve", 0.0, roofline, spec, settings)
    alone = summarize(alone_run, settings.slo)
    finetune_alone = max(alone.finetune_tokens_per_s, alone.finetune_steady_tokens_per_s or 0.0)
    compute_rate = finetune_compute_rate(alone_run, roofline)
    print(f"  fine-tuning alone {finetune_alone:.0f} tok/s (its FLOPs alone: {compute_rate:.0f})", flush=True)
    rows: list[dict[str, Any]] = []
    summaries = []
    for rate in rates:
        rate_rows = _measure_rate(setup, roofline, spec, rate, settings)
        rows += rate_rows
        inference_s = served_inference_s(rate_rows)
        bound = finetune_bound(compute_rate, inference_s, settings.window_s)
        summaries.append(rate_summary(rows, rate, bound, inference_s / settings.window_s, finetune_alone))
        print(f"  {'bound':>17} rate {rate:<5g} inference compute {inference_s / settings.window_s:.2f} of the "
              f"GPU: any policy <= {bound:.0f} tok/s", flush=True)
    return {"model": model.name, "gpu": gpu.name, "roofline": roofline_facts(roofline),
            "calibration": {"heldout_mape_percent": fit.heldout_mape, "heldout_mean_ratio": fit.heldout_mean_ratio,
                            "safety_margin": setup.safety_margin, "strict_safety_margin": setup.strict_safety_margin,
                            "warmup_overrun": overrun, "coefficients": fit.model.coefficients},
            "finetune_alone_tokens_per_s": finetune_alone, "finetune_compute_tokens_per_s": compute_rate,
            "runs": rows, "rates": summaries}


def roofline_facts(roofline: RooflineModel) -> dict[str, Any]:
    """The roofline's inputs and a few of its answers, for the JSON."""
    def decode_ms(batch: int, context: int = 512) -> float:
        return 1000.0 * roofline.predict(PlanFeatures(decode_tokens=batch, decode_context=batch * context,
                                                      num_sequences=batch))
    return {"gpu": dataclasses.asdict(roofline.gpu), "model": dataclasses.asdict(roofline.model),
            "fixed_costs": dataclasses.asdict(roofline.fixed), "ridge_rows": roofline.ridge_rows(),
            "decode_ms": {str(b): decode_ms(b) for b in (1, 8, 32, 128)}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of `coserve bench gpu-projection`."""
    ap.add_argument("--models", default="1b,8b", help="comma-separated: 1b (Llama-3.2-1B), 8b (Llama-3.1-8B)")
    ap.add_argument("--gpus", default="a100,h100", help="comma-separated: a100, h100 (80 GB SXM)")
    ap.add_argument("--rates", default=None, help="comma-separated requests/s per GPU (default: per model)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policy names")
    ap.add_argument("--window-s", type=float, default=60.0, help="arrival window per run (simulated seconds)")
    ap.add_argument("--tpot-slo-ms", type=float, default=SLO_FLEXLLM.tpot_s * 1000.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=SLO_FLEXLLM.ttft_s * 1000.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")


def _names(text: str, known: Sequence[str], what: str, any_name: bool = False) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [] if any_name else [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {what} {unknown or text!r}: use {', '.join(known)}")
    return names


def _settings(args: argparse.Namespace) -> tuple[list[str], list[str], list[float] | None, ProjectionSettings]:
    """The models, GPUs, rates and settings the arguments ask for. Raises ValueError naming a bad one."""
    models, gpus = _names(args.models, list(MODELS), "model"), _names(args.gpus, list(GPUS), "GPU")
    rates = [float(r) for r in args.rates.split(",")] if args.rates else None
    if rates is not None and not all(r > 0 for r in rates):
        raise ValueError(f"--rates must be positive requests/s, got {args.rates!r}")
    if not (args.window_s > 0 and args.tpot_slo_ms > 0 and args.ttft_slo_ms > 0):
        raise ValueError("--window-s, --tpot-slo-ms and --ttft-slo-ms must be > 0")
    slo = SLO(ttft_s=args.ttft_slo_ms / 1000.0, tpot_s=args.tpot_slo_ms / 1000.0)
    settings = ProjectionSettings(window_s=args.window_s, policies=tuple(_names(args.policies, [], "policy", True)),
                                  slo=slo, seed=args.seed)
    probe = PolicySetup(scheduler=SCHEDULER, slo=slo, latency=LatencyModel(ModelFingerprint("", "", "")))
    for name in settings.policies:
        make_factory(name, probe)  # ValueError naming an unknown policy
    return models, gpus, rates, settings


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces a run with these arguments."""
    line = (f"coserve bench gpu-projection --models {args.models} --gpus {args.gpus} --policies {args.policies} "
            f"--window-s {args.window_s:g} --tpot-slo-ms {args.tpot_slo_ms:g} --ttft-slo-ms {args.ttft_slo_ms:g} "
            f"--seed {args.seed}")
    return line + (f" --rates {args.rates}" if args.rates else "") + (f" --json {args.json}" if args.json else "")


def run_projection(args: argparse.Namespace) -> dict[str, Any]:
    """Every (model, GPU) scenario the arguments ask for; the JSON document. Raises ValueError (before any
    run) when an argument is bad."""
    models, gpus, rates, settings = _settings(args)
    t0 = time.monotonic()
    scenarios = [project_scenario(m, g, rates or RATES[m], settings) for m in models for g in gpus]
    meta = {"command": command_line(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "wall_s": time.monotonic() - t0, "machine": machine_id(),
            "slo": {"tpot_ms": args.tpot_slo_ms, "ttft_ms": args.ttft_slo_ms}, "window_s": args.window_s,
            "seed": args.seed, "policies": list(settings.policies), "min_attainment": MIN_ATTAINMENT,
            "scheduler": {"max_num_seqs": SCHEDULER.max_num_seqs, "max_batch_tokens": SCHEDULER.max_batch_tokens,
                          "num_kv_blocks": NUM_KV_BLOCKS}, "finetune_tokens": list(settings.finetune_tokens),
            "note": "a simulation on published figures (coserve.bench.roofline), not a GPU measurement"}
    return {"meta": meta, "scenarios": scenarios}


def run_command(args: argparse.Namespace) -> int:
    """Handler of `coserve bench gpu-projection`: run, print the markdown, write the JSON."""
    try:
        _settings(args)
    except ValueError as error:  # a usage error, reported before any run
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = run_projection(args)
    print(render_markdown(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coserve.bench.gpu_projection", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run_command(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
