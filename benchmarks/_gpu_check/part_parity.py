"""Parity: coserve's native engine against transformers (+ peft) on the same device, per model shape.

Each shape's prompts run twice in one batch: once through the base model, once through the adapter.
fp32 (TF32 off): the greedy tokens must be identical, row for row, and the top log-probs of every step
whose context the two engines share must agree within `FP32_LOGPROB_TOL`. bf16 is held to transformers'
own bf16: the first output token's top log-probs (the same context in every run) against the fp32
reference (transformers in fp32) must be within max(`BF16_ERR_FLOOR`, `BF16_ERR_RATIO` x transformers-bf16's
error there), and at least `MIN_FIRST_TOKEN_AGREEMENT` of the first tokens must equal transformers-bf16's.
How far greedy decoding stays together in bf16 is reported: a near tie rounded differently sends the two
continuations apart, and from there they differ.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from _gpu_check import hf_side
from _gpu_check.context import Context, exact_fp32, free_memory
from _gpu_check.coserve_side import TOP_LOGPROBS, greedy, make_llm
from _gpu_check.models import random_prompts
from _gpu_check.record import PartRecord
from _gpu_check.shapes import PARITY_MODELS
from engine_throughput import compare  # the throughput benchmark's agreement measure

FP32_LOGPROB_TOL = 1e-3
BF16_ERR_FLOOR = 0.05
BF16_ERR_RATIO = 2.0
MIN_FIRST_TOKEN_AGREEMENT = 0.75

Tops = list[list[dict[int, float]]]  # per row, per step: {token id: log-prob} of the top tokens


def logprob_errors(tokens: list[list[int]], tops: Tops, ref_tokens: list[list[int]],
                   ref_lps: torch.Tensor) -> tuple[float, float]:
    """Max |log-prob - the reference's| over the top tokens of (a) every step whose context both share,
    (b) the first step."""
    shared = first = 0.0
    for row, steps in enumerate(tops):
        for step, top in enumerate(steps):
            if tokens[row][:step] != ref_tokens[row][:step]:
                break
            worst = max(abs(value - float(ref_lps[row, step, tid])) for tid, value in top.items())
            shared = max(shared, worst)
            if step == 0:
                first = max(first, worst)
    return shared, first


def top_of(lps: torch.Tensor, k: int = TOP_LOGPROBS) -> Tops:
    """The top-k {token id: log-prob} of every row and step of a [rows, steps, vocab] log-softmax."""
    values, ids = lps.topk(k, dim=-1)
    return [[dict(zip(i.tolist(), v.tolist())) for i, v in zip(row_ids, row_values)]
            for row_ids, row_values in zip(ids, values)]


def _engines(ctx: Context, name: str, dtype: str, prompts: list[list[int]], lora_rows: list[bool]
             ) -> tuple[list[list[int]], Tops, list[list[int]], torch.Tensor]:
    """coserve's greedy tokens and top log-probs, then transformers': tokens and the full log-softmax."""
    sizes, model_dir, adapter_dir = ctx.sizes, ctx.models.model(name), ctx.models.adapter(name)
    llm = make_llm(ctx, model_dir, dtype, len(prompts), sizes.parity_kv_blocks, 4096)
    co_tokens, co_tops = greedy(llm, adapter_dir, prompts, lora_rows, sizes.parity_tokens)
    del llm
    free_memory()
    pad_id = int(json.loads((model_dir / "config.json").read_text()).get("pad_token_id") or 0)
    model = hf_side.load(model_dir, getattr(torch, dtype), ctx.device, adapter_dir)
    hf_tokens, hf_lps = hf_side.greedy_logprobs(model, prompts, lora_rows, sizes.parity_tokens, pad_id)
    del model
    free_memory()
    return co_tokens, co_tops, hf_tokens, hf_lps


def _agreement(co_tokens: list[list[int]], co_tops: Tops, hf_tokens: list[list[int]], hf_lps: torch.Tensor,
               lora_rows: list[bool]) -> dict[str, Any]:
    base = [i for i, m in enumerate(lora_rows) if not m]
    lora = [i for i, m in enumerate(lora_rows) if m]
    shared, first = logprob_errors(co_tokens, co_tops, hf_tokens, hf_lps)
    return {"base": compare(co_tokens, hf_tokens, base), "lora": compare(co_tokens, hf_tokens, lora),
            "max_abs_logprob_diff_shared_context": shared, "max_abs_logprob_diff_first_token": first,
            "first_token_agreement": sum(a[:1] == b[:1] for a, b in zip(co_tokens, hf_tokens)) / len(co_tokens),
            "adapter_changes_outputs": sum(co_tokens[i] != co_tokens[j] for i, j in zip(base, lora)) / len(lora)}


def _shape(ctx: Context, rec: PartRecord, name: str) -> dict[str, Any]:
    """fp32 and bf16 on one shape: agreement with transformers, bf16 accuracy against the fp32 reference."""
    prompts = random_prompts(int(ctx.shapes[name].fields["vocab_size"]), ctx.sizes.parity_prompts,
                             ctx.sizes.prompt_len, seed=11)
    both, rows = prompts + prompts, [False] * len(prompts) + [True] * len(prompts)
    co, co_tops, ref_tokens, ref_lps = _engines(ctx, name, "float32", both, rows)
    fp32 = rec.details[f"{name}/float32"] = _agreement(co, co_tops, ref_tokens, ref_lps, rows)
    co16, co16_tops, hf16, hf16_lps = _engines(ctx, name, "bfloat16", both, rows)
    bf16 = rec.details[f"{name}/bfloat16"] = _agreement(co16, co16_tops, hf16, hf16_lps, rows)
    co_shared, co_first = logprob_errors(co16, co16_tops, ref_tokens, ref_lps)
    hf_shared, hf_first = logprob_errors(hf16, top_of(hf16_lps), ref_tokens, ref_lps)
    bf16["vs_fp32_reference"] = {"coserve_first_token": co_first, "hf_first_token": hf_first,
                                 "coserve_shared_context": co_shared, "hf_shared_context": hf_shared}
    _checks(rec, name, fp32, bf16)
    return fp32


def _checks(rec: PartRecord, name: str, fp32: dict[str, Any], bf16: dict[str, Any]) -> None:
    for rows in ("base", "lora"):
        match = fp32[rows]["sequence_match"]
        rec.check(f"{name} fp32 {'LoRA' if rows == 'lora' else rows} rows: greedy tokens identical", match, "== 1",
                  match == 1.0)
    rec.at_most(f"{name} fp32 max abs d-logprob (top {TOP_LOGPROBS}, shared context)",
                fp32["max_abs_logprob_diff_shared_context"], FP32_LOGPROB_TOL)
    rec.check(f"{name} adapter changes the greedy tokens (share of LoRA rows)", fp32["adapter_changes_outputs"],
              "> 0", fp32["adapter_changes_outputs"] > 0)
    ref = bf16["vs_fp32_reference"]
    limit = max(BF16_ERR_FLOOR, BF16_ERR_RATIO * ref["hf_first_token"])
    rec.check(f"{name} bf16 first-token max abs d-logprob vs the fp32 reference", ref["coserve_first_token"],
              f"<= max({BF16_ERR_FLOOR:g}, {BF16_ERR_RATIO:g} x transformers-bf16's {ref['hf_first_token']:.3g})",
              ref["coserve_first_token"] <= limit)
    rec.at_least(f"{name} bf16 first-token agreement", bf16["first_token_agreement"], MIN_FIRST_TOKEN_AGREEMENT)
    rec.check(f"{name} bf16 greedy token agreement base/LoRA",
              [round(bf16["base"]["token_match"], 3), round(bf16["lora"]["token_match"], 3)])


def run(ctx: Context, rec: PartRecord) -> None:
    exact_fp32()
    identical = 0
    for name in PARITY_MODELS:
        fp32 = _shape(ctx, rec, name)
        identical += fp32["base"]["sequence_match"] == 1.0 and fp32["lora"]["sequence_match"] == 1.0
    worst = max(rec.details[f"{n}/bfloat16"]["vs_fp32_reference"]["coserve_first_token"] for n in PARITY_MODELS)
    hf = max(rec.details[f"{n}/bfloat16"]["vs_fp32_reference"]["hf_first_token"] for n in PARITY_MODELS)
    rec.summary = (f"fp32 greedy identical (base and LoRA rows) on {identical}/{len(PARITY_MODELS)} shapes; "
                   f"bf16 first-token error vs fp32: coserve {worst:.3g}, transformers {hf:.3g}")
