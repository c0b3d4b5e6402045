"""`coserve bench co-serving`: inference arrivals + one fine-tuning job, once per policy and rate.

    coserve bench co-serving [--quick] --json OUT [--plots DIR]

On one in-process engine (the `small` preset by default, float32, CPU):

1. Fit the latency model on a short sweep of real iterations (`calibration.profile_engine`), measure
   the solo decode step at batch 8 and derive the SLOs from it (`calibration.calibrate_slo`: TPOT = 3 x
   that step, TTFT = 40 x TPOT); refit it with a few seconds of real co-serving iterations added
   (`calibrate`), and derive from the final model the policies' safety margins (held-out bias; for
   coserve-strict also the warm-up's overrun, see `calibrate`) and `max_num_seqs`; coserve's longest
   stall is `--stall-multiple` (3) x the TPOT SLO. All are printed and written to the JSON.
2. Measure fine-tuning alone (`finetune_only_tokens_per_s`): the coserve policy with no inference.
3. For every rate and policy: a Poisson trace of `window_s` seconds (ShareGPT-like lengths divided by
   4, see `traces`) replayed against the wall clock with the fine-tuning job running, then a drain of
   at least the TTFT SLO; metrics as defined in `metrics`.
4. One bursty on/off trace (BurstGPT-shaped) at the middle rate with coserve, for the timeline plot.
5. `headroom`: at each rate, an upper bound on any policy's fine-tuning throughput from the coserve
   run's inference work (`headroom`), next to 1.3x the best baseline that keeps the SLO.
6. `simulator_check`: each coserve run replayed in the simulator (`sim_check`): measured and
   simulated metrics side by side with their relative error.

`--tpot-slo-ms` (and `--ttft-slo-ms`) replace the calibrated SLOs, e.g. with the papers' 50 ms TPOT for
an 8B model on a GPU (`--device cuda --dtype bfloat16 --model-dir <real-size shape>`).

The fine-tuning job: 64 synthetic chat examples of 256-1024 tokens (`traces.synthetic_chat_dataset`;
`--finetune-tokens 64,256` for a real model such as SmolLM2-135M, whose 1024-token steps outlast a short
window), LoRA r=16 alpha=32 on all seven projections, batch size 1 (so the window sees many completed
optimizer steps), AdamW, as many epochs as allowed (it never ends during a run). Each run starts the job
afresh. A real model is `--model-dir DIR` with lower `--rates` (RESULTS.md has SmolLM2's command).
`--method dpo` makes it a DPO job (beta 0.1) on 64 preference pairs, each answer 256-1024 templated
tokens with its question (`traces.synthetic_preference_rows`): its reference passes (the base model
with the adapter off, each pair's once) are fine-tuning forward work the policy co-serves like any other,
and `finetune_sequences_per_s` / 2 is its trained pairs/s. `--method reinforcement` makes it a GRPO job
whose rollouts are co-served inference (`coserving_rl`: RL steps/s and each step's rollout and training
time per run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coserve.bench.calibration import TTFT_MULTIPLE, SweepSettings
from coserve.bench.coserving_rl import (
    DEFAULT_ROLLOUT_TOKENS,
    reinforcement_metrics,
    reinforcement_spec,
    rollout_setup,
)
from coserve.bench.coserving_rows import bound_line, calibration_lines, gap_rows, pacing_line, run_line
from coserve.bench.coserving_setup import MAX_BATCH_TOKENS, calibrate, run_policy
from coserve.bench.gap_breakdown import gap_breakdown, work_per_token_s, work_tokens_per_s
from coserve.bench.headroom import best_baseline, headroom
from coserve.bench.pacing import pacing
from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RolloutSetup, RunLimits, RunRecord
from coserve.bench.run_metrics import SLO, summarize
from coserve.bench.sim_check import simulator_check
from coserve.bench.simulator import EngineShape
from coserve.bench.slo_bound import forced_constants
from coserve.bench.traces import (
    bursty_arrivals,
    make_trace,
    poisson_arrivals,
    synthetic_chat_dataset,
    synthetic_preference_rows,
)
from coserve.contract.engine import EngineKind
from coserve.contract.job_request import FineTuningMethod
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings

# Rates: the small preset on 2 CPU cores serves about 3.5 requests/s of this trace before queues grow
# (measured 2026-11-21); below ~1 request/s the engine idles and every work-conserving baseline trains
# as fast as coserve, so the quick set spans the range where sharing matters.
QUICK_RATES = (1.0, 2.0, 3.0)
FULL_RATES = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5)
# static-split-0.02: a share small enough for its fixed fine-tuning work to fit the TPOT SLO here
# (0.1 does not: TPOT p50 114-152 ms against a 90 ms SLO in a smoke run).
QUICK_POLICIES = ("coserve", "temporal-n16", "temporal-n128", "dynamic-temporal", "static-split-0.02")
FULL_POLICIES = ("coserve", "coserve-strict", "temporal-n16", "temporal-n64", "temporal-n256", "dynamic-temporal",
                 "static-split-0.02", "static-split-0.1")
# 1 GiB of KV on the small preset: static-split-0.02's fine-tuning range (81 blocks) still holds one
# 1024-token training sequence (with 1024 blocks it held 320 tokens and the job never started).
NUM_KV_BLOCKS = 4096
TRAINING_ADAPTER_ID = 2**41  # far from user adapter ids, like the offline API's
WARMUP_S = 6.0  # co-serving seconds of the calibration's second pass
# coserve's fine-tuning bursts: at most this many TPOT SLOs between two tokens of a request. On this
# CPU an iteration's fixed cost (weights read, per-layer launches, the window's loss) is a large part
# of a TPOT-sized iteration; 3 x pays it once per ~3 SLOs (measured: FT-only 328 -> 368 tok/s, rate 1
# 192 -> 236, rate 2 126 -> 192; 2026-11-21, /tmp runs noted in RESULTS.md).
STALL_MULTIPLE = 3.0
FINETUNE_TOKENS = (256, 1024)  # the fine-tuning examples' length range, templated tokens
QUICK_SWEEP = SweepSettings(decode_batches=(1, 8, 16), decode_steps=4, forward_windows=(32, 128, 256),
                            backward_budgets=(512, 2048))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of `coserve bench co-serving`."""
    ap.add_argument("--quick", action="store_true",
                    help=f"rates {QUICK_RATES}, 5 policies, 16 s windows (about 6 minutes here)")
    ap.add_argument("--json", type=Path, required=True, help="write the results here")
    ap.add_argument("--plots", type=Path, default=None, help="write PNG plots into this folder")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="HF model folder (default: the small preset, created under benchmarks/out)")
    ap.add_argument("--rates", default=None, help="comma-separated requests/s (overrides the default set)")
    ap.add_argument("--policies", default=None, help="comma-separated policy names (see policy_set)")
    ap.add_argument("--window-s", type=float, default=None,
                    help="arrival window per run (default 16 quick, 40 otherwise)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="engine device: cpu, cuda, cuda:1, ... (default cpu)")
    ap.add_argument("--engine", type=EngineKind.parse, default=EngineKind.TORCH,
                    metavar="{" + ",".join(k.value for k in EngineKind) + "}",
                    help="the backend, as `coserve serve --engine` (default: torch)")
    ap.add_argument("--dtype", default="float32", help="engine dtype (default float32)")
    ap.add_argument("--tpot-slo-ms", type=float, default=None,
                    help="use this TPOT SLO instead of the calibrated one (e.g. 50 for an 8B model on a GPU)")
    ap.add_argument("--ttft-slo-ms", type=float, default=None,
                    help="TTFT SLO with --tpot-slo-ms (default: 40 x the TPOT SLO)")
    ap.add_argument("--stall-multiple", type=float, default=STALL_MULTIPLE,
                    help=f"coserve's max_stall_ms as a multiple of the TPOT SLO, >= 1 (default "
                         f"{STALL_MULTIPLE:g}; the policy coserve-strict has none)")
    ap.add_argument("--seed", type=int, default=0, help="seed of traces and the fine-tuning data")
    ap.add_argument("--method", choices=[m.value for m in FineTuningMethod], default="supervised",
                    help="the fine-tuning job: supervised (chat examples), dpo (preference pairs of two "
                         "answers to one question, beta 0.1; its reference passes are co-served too) or "
                         "reinforcement (GRPO; its rollouts are co-served inference)")
    ap.add_argument("--rollout-tokens", type=int, default=DEFAULT_ROLLOUT_TOKENS,
                    help=f"with --method reinforcement: the longest rollout (default {DEFAULT_ROLLOUT_TOKENS})")
    ap.add_argument("--finetune-tokens", default=f"{FINETUNE_TOKENS[0]},{FINETUNE_TOKENS[1]}",
                    help="MIN,MAX templated tokens of the fine-tuning examples (default "
                         f"{FINETUNE_TOKENS[0]},{FINETUNE_TOKENS[1]}; 64,256 for a real model on a CPU)")


def _settings(args: argparse.Namespace) -> tuple[list[float], list[str], float]:
    rates = [float(r) for r in args.rates.split(",")] if args.rates else \
        list(QUICK_RATES if args.quick else FULL_RATES)
    policies = [p.strip() for p in args.policies.split(",")] if args.policies else \
        list(QUICK_POLICIES if args.quick else FULL_POLICIES)
    window = args.window_s if args.window_s is not None else (16.0 if args.quick else 40.0)
    return rates, policies, window


@dataclass(frozen=True, slots=True)
class BenchJob:
    """The engine, the job every run trains, the job the latency model is calibrated with (the same but
    supervised for a reinforcement job), its rollouts' setup (reinforcement only) and the model's line."""

    engine: Any
    spec: FinetuneJobSpec
    calibration_spec: FinetuneJobSpec
    rollouts: RolloutSetup | None
    model: str


def engine_and_job(args: argparse.Namespace, workdir: Path) -> tuple[Any, Any, str]:
    """The engine, the prepared fine-tuning job and a description of the model."""
    job = bench_job(args, workdir)
    return job.engine, job.spec, job.model


def bench_job(args: argparse.Namespace, workdir: Path) -> BenchJob:
    """The engine and the jobs of a run (`BenchJob`)."""
    from transformers import AutoTokenizer

    from coserve.backends.registry import build_engine
    from coserve.bench.trainer import ensure_model
    from coserve.contract.engine_config import EngineConfig

    model_dir, origin = ensure_model(args.model_dir)
    engine = build_engine(EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device,
                                       num_kv_blocks=NUM_KV_BLOCKS, block_size=16, max_loras=2,
                                       max_lora_rank=16, seed=args.seed, engine=args.engine,
                                       max_num_seqs=32, max_batch_tokens=2 * MAX_BATCH_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    method, lengths = FineTuningMethod(args.method), finetune_tokens(args.finetune_tokens)
    cfg = engine.model_config

    def spec(kind: FineTuningMethod) -> FinetuneJobSpec:
        return bench_job_spec(tokenizer, cfg.num_layers, engine.layout.max_model_len, workdir / "job", args.seed,
                              lengths, kind, rollout_tokens=args.rollout_tokens)

    trained = spec(method)
    reinforcement = method == FineTuningMethod.REINFORCEMENT
    model = (f"{model_dir.name} ({origin}): {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
             f"vocab {cfg.vocab_size}, {args.dtype} on {args.device}, engine {args.engine.value}")
    return BenchJob(engine, trained, spec(FineTuningMethod.SUPERVISED) if reinforcement else trained,
                    rollout_setup(tokenizer, list(cfg.eos_token_ids)) if reinforcement else None, model)


def finetune_tokens(text: str) -> tuple[int, int]:
    """`--finetune-tokens MIN,MAX` as a pair; ValueError naming the option when it is not one."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or not 16 <= int(parts[0]) <= int(parts[1]):
        raise ValueError(f"--finetune-tokens must be MIN,MAX with 16 <= MIN <= MAX, got {text!r}")
    return int(parts[0]), int(parts[1])


def bench_job_spec(tokenizer: Any, num_layers: int, max_len: int, output_dir: Path,
                   seed: int, lengths: tuple[int, int] = FINETUNE_TOKENS,
                   method: FineTuningMethod = FineTuningMethod.SUPERVISED,
                   rollout_tokens: int = DEFAULT_ROLLOUT_TOKENS) -> FinetuneJobSpec:
    """The benchmark's fine-tuning job (module docstring) as a `FinetuneJobSpec`; `lengths` is the
    examples' range of templated tokens (each answer of a DPO pair, with its question)."""
    from coserve.jobs.prepared_job import prepare_job

    if method == FineTuningMethod.REINFORCEMENT:
        return reinforcement_spec(tokenizer, num_layers, max_len, output_dir, seed, lengths, TRAINING_ADAPTER_ID,
                                  rollout_tokens)
    if method == FineTuningMethod.DPO:
        examples = synthetic_preference_rows(tokenizer, 64, seed, lengths[0], lengths[1])
        loss = LossSpec(LossKind.DPO, beta=0.1)
    else:
        examples = synthetic_chat_dataset(tokenizer, 64, seed, lengths[0], lengths[1])
        loss = LossSpec()
    return prepare_job(tokenizer, examples, job_id="bench", tenant="finetune", adapter_id=TRAINING_ADAPTER_ID,
                       num_layers=num_layers, max_len=max_len, output_dir=output_dir,
                       hyperparameters=HyperparameterRequest(n_epochs=50, batch_size=1),
                       lora=LoRASettings(r=16, lora_alpha=32),
                       seed=seed, loss=loss).spec


def _given_slo(args: argparse.Namespace) -> SLO | None:
    if args.tpot_slo_ms is None:
        return None
    ttft_ms = args.ttft_slo_ms if args.ttft_slo_ms is not None else TTFT_MULTIPLE * args.tpot_slo_ms
    return SLO(ttft_s=ttft_ms / 1000.0, tpot_s=args.tpot_slo_ms / 1000.0)


def _measure(engine: Any, setup: PolicySetup, job_spec: Any, rates: list[float], policies: list[str],
             limits: RunLimits, seed: int, solo: RunRecord, finetune_only: float,
             rollouts: RolloutSetup | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every (rate, policy) run: the metrics rows ("runs"), and for the coserve runs the simulator
    checks ("simulator_check", not for a reinforcement job), the fine-tuning bounds of `headroom`
    ("headroom") and the gap to them split into its parts (`gap_breakdown`, with `solo` the run of
    fine-tuning alone)."""
    layout = engine.layout
    shape = EngineShape(layout.num_kv_blocks, layout.block_size, layout.num_adapter_slots,
                        layout.vocab_size, engine.model_config.num_layers)
    out: dict[str, list[dict[str, Any]]] = {"runs": [], "simulator_check": [], "headroom": [], "gap_breakdown": []}
    runs, per_work = out["runs"], work_per_token_s(solo, setup.latency)
    for rate in rates:
        trace = make_trace(poisson_arrivals(rate, limits.window_s, seed), seed)
        ours = None
        for policy in policies:
            record = run_policy(engine, setup, job_spec, policy, rate, trace, limits, f"{policy}-{rate}", rollouts)
            runs.append(_run_row(record, setup.slo))
            runs[-1]["finetune_work_tokens_per_s"] = work_tokens_per_s(record, setup.latency, per_work)
            print(run_line(runs[-1]), flush=True)
            if policy == "coserve":
                ours = record
            if policy == "coserve" and rollouts is None:
                out["simulator_check"].append(simulator_check(record, setup, trace, limits, job_spec, shape))
        if ours is not None:
            against_bounds(ours, solo, setup, finetune_only, out)
    return out


def against_bounds(ours: RunRecord, solo: RunRecord, setup: PolicySetup, finetune_only: float,
                    out: dict[str, list[dict[str, Any]]]) -> None:
    """coserve's run at a rate against the bounds (`headroom`, `slo_bound`), its gap to them by term and
    its pacing (`pacing`), into `out` ("headroom", "gap_breakdown") and on the console; `out["runs"]` holds
    the rows of every policy's run at the rate so far (for the best baseline; may be empty)."""
    runs, rate, constant = out["runs"], ours.rate, setup.latency.coefficients.get("constant", 0.0)
    forced = forced_constants(ours, solo, setup.slo, constant)
    bound = headroom(ours, setup.latency, finetune_only, best_baseline(runs, rate), forced=forced)
    out["headroom"].append(bound.to_dict())
    print(bound_line(bound), flush=True)
    gap, paced = gap_breakdown(ours, solo, setup.latency, finetune_only), pacing(ours, setup.slo.tpot_s, constant)
    best = best_baseline(runs, rate, key="finetune_work_tokens_per_s")
    out["gap_breakdown"].append({**gap.to_dict(), "best_baseline_work_tokens_per_s": best,
                                 "pacing": paced.to_dict()})
    print(gap_rows(gap, best, bound.slo_bound_tokens_per_s), flush=True)
    print(pacing_line(paced), flush=True)


def _run_row(record: Any, slo: SLO) -> dict[str, Any]:
    """A run's metrics, with a reinforcement job's RL steps/s and phases."""
    metrics = summarize(record, slo)
    row = metrics.to_dict()
    if record.rollout_phases is not None:
        row.update(reinforcement_metrics(record, metrics.finetune_sequences_per_s))
    return row


def _setup_settings(setup: PolicySetup) -> dict[str, Any]:
    """The policies' limits and margins, as the JSON's settings name them."""
    return {"max_num_seqs": setup.scheduler.max_num_seqs, "max_batch_tokens": MAX_BATCH_TOKENS,
            "safety_margin": setup.safety_margin, "strict_safety_margin": setup.strict_safety_margin,
            "max_stall_ms": setup.max_stall_ms, "burst_margin": setup.burst_margin}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run everything (module docstring); returns the JSON document (and the bursty run's record under
    the private key ``_bursty``, for the plots)."""
    import torch

    from coserve.planner.latency import machine_id

    if args.threads:
        torch.set_num_threads(args.threads)
    rates, policies, window = _settings(args)
    with tempfile.TemporaryDirectory(prefix="coserve-bench-") as tmp:
        job = bench_job(args, Path(tmp))
        engine, job_spec, model, rollouts = job.engine, job.spec, job.model, job.rollouts
        t0 = time.monotonic()
        sweep = QUICK_SWEEP if args.quick else SweepSettings()
        setup, fit, overrun = calibrate(engine, job.calibration_spec, rates[len(rates) // 2], args.seed, sweep,
                                         min(WARMUP_S, window), args.stall_multiple, _given_slo(args))
        slo = setup.slo
        print(calibration_lines(fit, setup, time.monotonic() - t0, os.getloadavg()[0]), flush=True)
        load_start = os.getloadavg()[0]
        limits = RunLimits(window, drain_s=max(slo.ttft_s, 2.0))
        solo = run_policy(engine, setup, job_spec, "coserve", 0.0, [], RunLimits(window, 0.0), "solo", rollouts)
        solo_metrics = summarize(solo, slo)
        finetune_only = solo_metrics.finetune_tokens_per_s
        print(f"fine-tuning only: {finetune_only:.1f} trained tokens/s (steady "
              f"{solo_metrics.finetune_steady_tokens_per_s or 0.0:.1f}), "
              f"{solo_metrics.finetune_sequences_per_s:.2f} sequences/s", flush=True)
        # The bound's reference: the steady estimate is free of the window's whole-step granularity.
        finetune_alone = max(finetune_only, solo_metrics.finetune_steady_tokens_per_s or 0.0)
        measured = _measure(engine, setup, job_spec, rates, policies, limits, args.seed, solo, finetune_alone,
                            rollouts)
        mid = rates[len(rates) // 2]
        bursty_trace = make_trace(bursty_arrivals(mid, window, args.seed), args.seed, prefix="b")
        bursty = run_policy(engine, setup, job_spec, "coserve", mid, bursty_trace, limits, "bursty", rollouts)
    return {
        "machine": machine_id(str(engine.device)), "model": model,
        "slo": {"tpot_ms": slo.tpot_s * 1000.0, "ttft_ms": slo.ttft_s * 1000.0},
        "finetune_only_tokens_per_s": finetune_only,
        "finetune_only_steady_tokens_per_s": solo_metrics.finetune_steady_tokens_per_s,
        "finetune_only_sequences_per_s": solo_metrics.finetune_sequences_per_s,
        "finetune_only": _run_row(solo, slo),
        "runs": measured["runs"], "headroom": measured["headroom"], "gap_breakdown": measured["gap_breakdown"],
        "bursty": {**_run_row(bursty, slo), "rate": mid},
        "simulator_check": measured["simulator_check"],
        "settings": {"window_s": window, "drain_s": limits.drain_s, "rates": rates, "policies": policies,
                     **_setup_settings(setup), "threads": torch.get_num_threads(),
                     "finetune_tokens": list(finetune_tokens(args.finetune_tokens)),
                     "method": args.method, "seed": args.seed,
                     "loadavg_1m": [load_start, os.getloadavg()[0]], "cpus": len(os.sched_getaffinity(0)),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "latency_model": {"heldout_mape_percent": fit.heldout_mape, "warmup_overrun": overrun,
                          "heldout_mean_ratio": fit.heldout_mean_ratio, "warning": fit.warning,
                          "coefficients": setup.latency.coefficients},
        "_bursty": bursty,
    }


def check_policy_names(names: list[str]) -> None:
    """Raise ValueError naming the first unknown policy (the factories parse the names)."""
    from coserve.inference.scheduler_config import SchedulerConfig
    from coserve.planner.latency import LatencyModel, ModelFingerprint

    setup = PolicySetup(scheduler=SchedulerConfig(max_model_len=64, max_num_seqs=1, max_batch_tokens=64),
                        slo=SLO(1.0, 1.0), latency=LatencyModel(ModelFingerprint("", "", "")))
    for name in names:
        make_factory(name, setup)


def run_coserving_benchmark(args: argparse.Namespace) -> int:
    """Handler of `coserve bench co-serving`: run, write the JSON (and plots), return an exit code."""
    try:
        check_policy_names(_settings(args)[1])
        finetune_tokens(args.finetune_tokens)
        if not 1.0 <= args.stall_multiple < math.inf:
            raise ValueError(f"--stall-multiple must be a number >= 1, got {args.stall_multiple}")
    except ValueError as error:  # a usage error, reported before minutes of work
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = run_benchmark(args)
    bursty = result.pop("_bursty")
    if args.plots is not None:
        from coserve.bench.plots import write_plots

        for path in write_plots(result, bursty, args.plots):
            print(f"wrote {path}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    print(f"wrote {args.json}")
    return 0
