"""Training benchmark (issue 3): coserve's windowed LoRA trainer vs transformers + peft, one process.

Workload: the ``small`` tiny llama (hidden 512, 8 layers, vocab 8192, float32, CPU), random 512-token
sequences (ids >= 8, fixed seed), the first half prompt and the second half answer (loss on the
answer only), batch 1: one AdamW step (lr 1e-4, weight decay 0, clipping at 1.0) per sequence. LoRA
r=16, alpha=32, dropout 0 on q/k/v/o/gate/up/down, fp32 master weights; both arms start from the same
adapter (PEFT's init from one seed: B = 0) and see the same sequences in the same order.

coserve schedules (``WindowedTrainer`` via ``train_batch``):

* ``w512``: one forward window of 512 tokens; per layer one backward tasklet of 512 tokens
  (last layer first): the default schedule of ``TrainingSequence(forward_windows=None)``.
* ``w128``: four forward windows of 128; per layer four backward tasklets of 128 (last window first).

Throughput: tokens per second of full steps (forward + backward + clip + AdamW), tokens = the 512
tokens of the sequence (``answer_tokens_per_s``: the 255 positions with a loss). The timed steps
alternate (coserve w512, HF, coserve w128, HF ...), so every ratio compares steps made seconds apart
on this noisy shared machine; the reported ratio is the median of the per-pair ratios.

Activation memory: see ``trainer_arms.py`` (one rule for both arms: peak over one instrumented,
untimed step of the trainer's kept buffers plus the live autograd-saved tensors, frozen weights and
LoRA parameters excluded, storages counted once). Bytes per token = that peak / 512.

Usage (from the repository root)::

    coserve bench trainer --quick --json benchmarks/out/trainer.json
    coserve bench trainer --json benchmarks/out/trainer.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

OUT_DIR = Path("benchmarks/out")  # the small model is created here (relative to the working folder)
SCHEDULES: dict[str, tuple[list[int], list[int]]] = {
    "w512": ([512], [512]),
    "w128": ([128] * 4, [128] * 4),
}
TARGET_MEMORY, TARGET_SPEED = 0.30, 0.65


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of `coserve bench trainer`."""
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 5 timed rounds (< 1 minute here)")
    ap.add_argument("--pairs", type=int, default=None, help="timed rounds (default 12, quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per arm (default 2)")
    ap.add_argument("--schedules", default="w512,w128",
                    help=f"coserve schedules to run, comma-separated, of {sorted(SCHEDULES)}")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="HF-format model folder (default: the small llama under benchmarks/out/)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sequences and the adapter")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")


def resolve_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick and check the schedules."""
    args.pairs = args.pairs if args.pairs is not None else (5 if args.quick else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown or not args.schedules:
        ap.error(f"unknown schedules {unknown}; choose from {sorted(SCHEDULES)}")
    return args


def ensure_model(model_dir: Path | None) -> tuple[Path, str]:
    """The given folder, or the ``small`` tiny llama (created if missing; see engine_throughput)."""
    if model_dir is not None:
        return model_dir.resolve(), "given"
    path = OUT_DIR / "small-llama"
    origin = "coserve create_tiny_model(arch=llama, preset=small, seed=0)"
    if not (path / "config.json").exists():
        from coserve.model.tiny_model import create_tiny_model

        create_tiny_model(path, arch="llama", preset="small", seed=0)
        (path / ".origin").write_text(origin + "\n")
    return path, origin


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _timed_rounds(args: argparse.Namespace, co: Any, hf: Any, data: list[Any], n_steps: int
                  ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Alternate coserve and HF steps (wall times and losses of the rounds after the warm-up)."""
    from coserve.bench import trainer_arms as arms

    walls: dict[str, list[float]] = {f"coserve_{n}": [] for n in args.schedules}
    walls["hf_peft"] = []
    losses: dict[str, list[float]] = {k: [] for k in walls}
    for step in range(n_steps):
        ids, trained = data[step + 1]
        for name in args.schedules:  # coserve, HF, coserve, HF ...: HF runs after each schedule
            arms_now = ((f"coserve_{name}", lambda ids=ids, trained=trained, name=name:
                         co.step(ids, trained, *SCHEDULES[name])),
                        ("hf_peft", lambda ids=ids, trained=trained: hf.step(ids, trained)))
            for key, fn in arms_now:
                if key == "hf_peft" and name != args.schedules[0] and len(args.schedules) > 1:
                    # one HF step per round is enough for the later schedules' pairs: reuse it
                    continue
                loss, wall = arms.timed(fn)
                if step >= args.warmup:
                    walls[key].append(wall)
                    losses[key].append(loss)
        print(f"[bench] round {step + 1}/{n_steps}: " + ", ".join(
            f"{k} {w[-1]:.2f}s" for k, w in walls.items() if w and step >= args.warmup),
            file=sys.stderr, flush=True)
    return walls, losses


def _arm_results(args: argparse.Namespace, walls: dict[str, list[float]], losses: dict[str, list[float]],
                 memory: dict[str, dict[str, Any]], tokens: int, answer_tokens: int) -> dict[str, Any]:
    """Per arm: bytes and tokens/s; per coserve schedule: the ratios to HF and the targets."""
    results: dict[str, Any] = {}
    for key, ws in walls.items():
        mem = memory[key]
        results[key] = {
            "activation_bytes_per_token": mem["peak_bytes"] / tokens,
            "kept_bytes_per_token_peak": mem["kept_peak_bytes"] / tokens,
            "saved_bytes_per_token_peak": mem["saved_peak_bytes"] / tokens,
            "activation_peak_mib": mem["peak_bytes"] / 2**20,
            "tokens_per_s": tokens / median(ws), "best_tokens_per_s": tokens / min(ws),
            "answer_tokens_per_s": answer_tokens / median(ws),
            "step_s": median(ws), "steps_s": ws, "losses": losses[key],
            "loss_first_step_memory_run": mem["loss"]}
        if key != "hf_peft":
            results[key]["schedule"] = {"forward_windows": SCHEDULES[key[8:]][0],
                                        "backward_windows_per_layer": SCHEDULES[key[8:]][1]}
    hf_res = results["hf_peft"]
    for name in args.schedules:
        r = results[f"coserve_{name}"]
        pairs = [h / c for c, h in zip(walls[f"coserve_{name}"], walls["hf_peft"])]
        r["pair_speed_ratios"] = pairs
        r["speed_ratio_vs_hf"] = median(pairs)  # coserve tok/s / HF tok/s, per adjacent pair
        r["memory_ratio_vs_hf"] = r["activation_bytes_per_token"] / hf_res["activation_bytes_per_token"]
        r["meets_targets"] = {"memory": r["memory_ratio_vs_hf"] <= TARGET_MEMORY,
                              "speed": r["speed_ratio_vs_hf"] >= TARGET_SPEED}
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from coserve.bench import trainer_arms as arms

    torch.set_num_threads(args.threads)
    model_dir, origin = ensure_model(args.model_dir)
    co = arms.CoserveArm(model_dir, seed=args.seed)
    hf = arms.HFArm(model_dir, co.initial_adapter())
    vocab = co.model.cfg.vocab_size
    n_steps = args.warmup + args.pairs
    data = arms.make_batch_data(vocab, n_steps + 1, seed=args.seed)
    tokens = arms.SEQ_LEN
    answer_tokens = int(data[0][1][1:].sum())  # positions with a target (token 0 is never one)

    # Memory: one instrumented, untimed step per arm on the first sequence.
    ids, trained = data[0]
    memory = {f"coserve_{name}": co.measure(ids, trained, *SCHEDULES[name])
              for name in args.schedules}
    memory["hf_peft"] = hf.measure(ids, trained)
    print(f"[bench] memory measured; timing {args.warmup} warm-up + {args.pairs} timed rounds",
          file=sys.stderr, flush=True)

    walls, losses = _timed_rounds(args, co, hf, data, n_steps)

    results = _arm_results(args, walls, losses, memory, tokens, answer_tokens)
    hf_res = results["hf_peft"]
    # The shape: "coserve" is the default schedule (the first one run).
    out = {"coserve": results[f"coserve_{args.schedules[0]}"], "hf_peft": hf_res,
           **{k: v for k, v in results.items() if k.startswith("coserve_")}}
    import peft
    import transformers

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "model": str(model_dir), "model_origin": origin, "threads": args.threads,
            "cpus": os.cpu_count(), "machine": platform.machine(), "processor": _cpu_name(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "quick": args.quick, "warmup_steps": args.warmup, "timed_rounds": args.pairs,
            "loadavg_1m_end": os.getloadavg()[0],
            "workload": {"seq_len": tokens, "answer_positions": answer_tokens, "batch_size": 1,
                         "lora_r": arms.R, "lora_alpha": arms.ALPHA, "lr": arms.LR,
                         "dtype": "float32", "seed": args.seed},
            "targets": {"memory_ratio_max": TARGET_MEMORY, "speed_ratio_min": TARGET_SPEED}}
    return {"meta": meta, **out}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def markdown(res: dict[str, Any]) -> str:
    head = ["arm", "activation B/token", "of which kept", "saved peak", "vs HF", "tok/s (median)",
            "best", "speed vs HF (median of pairs)"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for key in [k for k in res if k.startswith("coserve_")] + ["hf_peft"]:
        r = res[key]
        ref = key == "hf_peft"
        lines.append("| " + " | ".join([
            key, f"{r['activation_bytes_per_token']:,.0f}", f"{r['kept_bytes_per_token_peak']:,.0f}",
            f"{r['saved_bytes_per_token_peak']:,.0f}",
            "ref" if ref else f"{r['memory_ratio_vs_hf']:.1%}",
            f"{r['tokens_per_s']:.0f}", f"{r['best_tokens_per_s']:.0f}",
            "ref" if ref else (f"{r['speed_ratio_vs_hf']:.2f}x ("
                               f"{min(r['pair_speed_ratios']):.2f}-{max(r['pair_speed_ratios']):.2f})"),
        ]) + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed (and resolved) arguments; prints a table, writes --json."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    res = run(args)
    print(markdown(res))
    for key in [k for k in res if k.startswith("coserve_")]:
        r = res[key]
        print(f"{key}: memory {r['memory_ratio_vs_hf']:.1%} of HF (target <= {TARGET_MEMORY:.0%}), "
              f"speed {r['speed_ratio_vs_hf']:.2f}x HF (target >= {TARGET_SPEED}x): "
              + ("OK" if all(r["meets_targets"].values()) else "MISSED " + ", ".join(
                  k for k, ok in r["meets_targets"].items() if not ok)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
        print(f"\nwrote {args.json}")
    return 0

