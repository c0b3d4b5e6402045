"""Trainer memory and speed: coserve's windowed trainer against transformers + peft, the two arms of
`coserve bench trainer` (`coserve.bench.trainer_arms`) on the main model in bf16 on the device.

Each optimizer step trains one sequence of `train_len` random tokens (the second half trained): coserve
in one window and in windows of `train_window` (one arm each, with its own copy of the weights), peft in
one full-sequence graph; LoRA r=16 alpha=32 on all seven projections, fp32 masters, AdamW; every arm starts
from the same adapter (PEFT's init from one seed). Per arm, after one warm-up step (optimizer state made):

* CUDA memory: `torch.cuda.max_memory_allocated` over one step minus what was allocated before it (weights,
  adapter, optimizer state), per sequence token and per trained token;
* activation bytes per token by the CPU benchmark's rule (`SavedMeter`: kept buffers + autograd-saved
  tensors), comparable with `coserve bench trainer`'s figures;
* tokens/s: the median of `train_steps` timed steps, the arms alternating.

Checks: the first step's loss of every arm (the same adapter, the same sequence) agrees with peft's within
`LOSS_REL_TOL`; the ratios are reported against the CPU benchmark's targets.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch

from _gpu_check.context import Context, free_memory
from _gpu_check.record import PartRecord
from _gpu_check.shapes import MAIN_MODEL

LOSS_REL_TOL = 0.02  # bf16: two correct implementations round differently


def _cuda_peak(ctx: Context, step: Any) -> float | None:
    """Bytes allocated at the peak of `step()` beyond what was allocated before it (None off CUDA)."""
    if not ctx.cuda:
        step()
        return None
    ctx.sync()
    before = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    step()
    ctx.sync()
    return float(torch.cuda.max_memory_allocated(ctx.device) - before)


Schedule = tuple[list[int], list[int]]  # forward windows, backward windows per layer


def _arms(ctx: Context) -> tuple[dict[str, tuple[Any, Schedule]], Any, list[Any]]:
    """One coserve arm per schedule, peft's arm, and the sequences (3 untimed, then the timed ones)."""
    from coserve.bench import trainer_arms as arms

    sizes, model_dir = ctx.sizes, ctx.models.model(MAIN_MODEL)
    n = sizes.train_len // sizes.train_window
    schedules = {f"w{sizes.train_len}": ([sizes.train_len], [sizes.train_len]),
                 f"w{sizes.train_window}": ([sizes.train_window] * n, [sizes.train_window] * n)}
    co = {f"coserve_{name}": (arms.CoserveArm(model_dir, seed=0, device=ctx.device, dtype=torch.bfloat16), windows)
          for name, windows in schedules.items()}
    first = next(iter(co.values()))[0]
    hf = arms.HFArm(model_dir, first.initial_adapter(), device=ctx.device, dtype=torch.bfloat16)
    data = arms.make_batch_data(first.model.cfg.vocab_size, 3 + sizes.train_steps, seed=0, seq_len=sizes.train_len)
    return co, hf, data


def _steps(co: dict[str, tuple[Any, Schedule]], hf: Any) -> dict[str, Any]:
    """One step function per arm: (ids, trained) -> loss."""
    out: dict[str, Any] = {key: (lambda ids, tr, arm=arm, fb=fb: arm.step(ids, tr, *fb))
                           for key, (arm, fb) in co.items()}
    out["hf_peft"] = hf.step
    return out


def _measure(ctx: Context, co: dict[str, tuple[Any, Schedule]], hf: Any, data: list[Any]) -> dict[str, dict[str, Any]]:
    sizes, steps = ctx.sizes, _steps(co, hf)
    trained_tokens = int(data[0][1][1:].sum())
    results: dict[str, dict[str, Any]] = {}
    for key, step in steps.items():  # the first step: the same initial adapter for every arm
        ids, trained = data[0]
        results[key] = {"first_loss": step(ids, trained)}
    for key, step in steps.items():
        ids, trained = data[1]
        peak = _cuda_peak(ctx, functools.partial(step, ids, trained))
        meter = hf.measure(*data[2]) if key == "hf_peft" else co[key][0].measure(*data[2], *co[key][1])
        results[key].update({
            "cuda_peak_bytes_per_token": None if peak is None else peak / sizes.train_len,
            "cuda_peak_bytes_per_trained_token": None if peak is None else peak / trained_tokens,
            "cuda_peak_mib": None if peak is None else peak / 2**20,
            "activation_bytes_per_token": meter["peak_bytes"] / sizes.train_len, "walls_s": []})
    for round_ in range(sizes.train_steps):
        ids, trained = data[3 + round_]
        for key, step in steps.items():
            _, wall = ctx.timed(functools.partial(step, ids, trained))
            results[key]["walls_s"].append(wall)
    for res in results.values():
        res["tokens_per_s"] = sizes.train_len / statistics.median(res["walls_s"])
    return results


def run(ctx: Context, rec: PartRecord) -> None:
    from coserve.bench.trainer import TARGET_MEMORY, TARGET_SPEED

    co, hf, data = _arms(ctx)
    results = _measure(ctx, co, hf, data)
    del co, hf
    free_memory()
    rec.details.update(results)
    ref = results["hf_peft"]
    memory_key = "cuda_peak_bytes_per_token" if ctx.cuda else "activation_bytes_per_token"
    lines = []
    for key in (k for k in results if k != "hf_peft"):
        res = results[key]
        rel = abs(res["first_loss"] - ref["first_loss"]) / abs(ref["first_loss"])
        rec.at_most(f"{key}: first-step loss vs peft's (rel.)", rel, LOSS_REL_TOL)
        memory, speed = res[memory_key] / ref[memory_key], res["tokens_per_s"] / ref["tokens_per_s"]
        res.update(memory_ratio_vs_hf=memory, speed_ratio_vs_hf=speed)
        rec.check(f"{key}: {memory_key.replace('_', ' ')} vs peft", memory,
                  f"target <= {TARGET_MEMORY:g} (reported)")
        if ctx.cuda:  # beside the CUDA peak: the CPU benchmark's measure, comparable with its figures
            rec.check(f"{key}: activation bytes/token vs peft (the CPU bench's rule)",
                      res["activation_bytes_per_token"] / ref["activation_bytes_per_token"])
        rec.check(f"{key}: tokens/s vs peft", speed, f"target >= {TARGET_SPEED:g} (reported)")
        lines.append(f"{key} memory {memory:.2f}x, speed {speed:.2f}x of peft")
    rec.summary = f"bf16, {ctx.sizes.train_len}-token sequences: " + "; ".join(lines)
