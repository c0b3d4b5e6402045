"""Engine throughput: coserve's native engine against transformers' batched `generate` (peft for the LoRA
half), the runners of `benchmarks/engine_throughput.py` (`_bench_arms`) on the main model in bf16.

Per workload (`base`: no adapter anywhere, plain transformers; `half-lora`: the odd rows through one
adapter, peft's mixed batch) both engines are loaded once; after one warm-up call each (the largest batch,
2 tokens), every batch size is timed once per engine, calls alternating. Output tokens/s = rows x tokens /
wall seconds of the call (device drained). Greedy outputs are compared row for row (bf16: a near tie
rounded differently sends the two continuations apart, so agreement is reported; the first token of at
least `MIN_FIRST_TOKEN_AGREEMENT` of the rows must agree).
"""

from __future__ import annotations

from typing import Any

import torch

import _bench_arms as arms
from _gpu_check.context import Context, free_memory
from _gpu_check.models import random_prompts
from _gpu_check.record import PartRecord
from _gpu_check.shapes import MAIN_MODEL
from engine_throughput import compare

DTYPE = "bfloat16"
MIN_FIRST_TOKEN_AGREEMENT = 0.75


def _spec(ctx: Context, workload: str, prompts: list[list[int]]) -> dict[str, Any]:
    sizes = ctx.sizes
    mask = [workload == "half-lora" and i % 2 == 1 for i in range(len(prompts))]
    return {"model_dir": str(ctx.models.model(MAIN_MODEL)), "adapter_dir": str(ctx.models.adapter(MAIN_MODEL)),
            "prompts": prompts, "lora_mask": mask, "max_tokens": sizes.throughput_tokens,
            "threads": torch.get_num_threads(), "warmup": prompts, "warmup_tokens": 2,
            "max_num_seqs": len(prompts), "max_batch_tokens": sizes.throughput_batch_tokens, "dtype": DTYPE,
            "device": ctx.device, "num_kv_blocks": sizes.throughput_kv_blocks}


def _batch(ctx: Context, co_run: Any, hf_run: Any, spec: dict[str, Any], rows: int) -> dict[str, Any]:
    prompts, mask, tokens = spec["prompts"][:rows], spec["lora_mask"][:rows], spec["max_tokens"]
    co_out, co_s = ctx.timed(lambda: co_run(prompts, mask, tokens))
    hf_out, hf_s = ctx.timed(lambda: hf_run(prompts, mask, tokens))
    base = [i for i, m in enumerate(mask) if not m]
    lora = [i for i, m in enumerate(mask) if m]
    result = {"rows": rows, "tokens": tokens, "coserve_tokens_per_s": sum(map(len, co_out)) / co_s,
              "hf_tokens_per_s": sum(map(len, hf_out)) / hf_s, "coserve_s": co_s, "hf_s": hf_s,
              "all_tokens": all(len(o) == tokens for o in co_out + hf_out),
              "first_token_agreement": sum(a[:1] == b[:1] for a, b in zip(co_out, hf_out)) / rows,
              "vs_hf_base": compare(co_out, hf_out, base)}
    if lora:
        result["vs_hf_lora"] = compare(co_out, hf_out, lora)
    result["speedup"] = result["coserve_tokens_per_s"] / result["hf_tokens_per_s"]
    return result


def _workload(ctx: Context, rec: PartRecord, workload: str, prompts: list[list[int]]) -> list[str]:
    spec = _spec(ctx, workload, prompts)
    co_run, llm = arms.coserve_runner(spec)
    hf_run, extra = arms.hf_runner(spec)
    for run in (co_run, hf_run):
        run(*arms.warmup_slice(spec), spec["warmup_tokens"])
    lines = []
    for rows in ctx.sizes.batches:
        res = _batch(ctx, co_run, hf_run, spec, rows)
        rec.details[f"{workload}/{rows}"] = res
        key = f"{workload} x{rows}"
        rec.check(f"{key}: every row has {res['tokens']} tokens (both engines)", res["all_tokens"], "true",
                  res["all_tokens"])
        rec.at_least(f"{key}: first-token agreement", res["first_token_agreement"], MIN_FIRST_TOKEN_AGREEMENT)
        rec.check(f"{key}: output tok/s coserve / transformers",
                  f"{res['coserve_tokens_per_s']:.0f} / {res['hf_tokens_per_s']:.0f} = {res['speedup']:.2f}x")
        agree = [res["vs_hf_base"]["token_match"]] + ([res["vs_hf_lora"]["token_match"]] if "vs_hf_lora" in res else [])
        rec.check(f"{key}: greedy token agreement " + ("base/LoRA rows" if len(agree) > 1 else "base rows"),
                  [round(a, 3) for a in agree])
        lines.append(f"{key} {res['speedup']:.2f}x")
    rec.details[f"{workload}/hf_notes"] = {k: v for k, v in extra.items() if k != "versions"}
    del co_run, hf_run, llm
    free_memory()
    return lines


def run(ctx: Context, rec: PartRecord) -> None:
    sizes = ctx.sizes
    vocab = int(ctx.shapes[MAIN_MODEL].fields["vocab_size"])
    prompts = random_prompts(vocab, max(sizes.batches), sizes.throughput_prompt_len, seed=21)
    lines = [line for workload in ("base", "half-lora") for line in _workload(ctx, rec, workload, prompts)]
    rec.summary = (f"{DTYPE}, {sizes.throughput_tokens} tokens per row, coserve/transformers output tok/s: "
                   + ", ".join(lines))
