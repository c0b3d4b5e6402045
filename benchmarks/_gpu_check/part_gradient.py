"""Gradient: the windowed trainer (`coserve.trainer`) on the device against peft's full-sequence backward.

One chat-shaped sequence (prompt, answer, user turn, answer; loss on the answers) of `grad_len` tokens,
trained once in a single window and once in windows of `grad_window` tokens (window edges inside the
answers, so a label taken from the wrong window would show). fp32 (TF32 off): every LoRA gradient within
`FP32_REL_ERR` of peft's (max |difference| over the tensor's max |value|, worst tensor) and the loss within
`FP32_LOSS_REL`. bf16 (base weights bf16, LoRA masters fp32): the windowed gradient against the fp32
reference within max(`BF16_REL_ERR_FLOOR`, 2 x peft-bf16's own error against that reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from _gpu_check import hf_side
from _gpu_check.context import Context, exact_fp32, free_memory
from _gpu_check.record import PartRecord

FP32_REL_ERR = 1e-4
FP32_LOSS_REL = 1e-5
BF16_REL_ERR_FLOOR = 0.05


def chat_sequence(vocab: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (>= 16) and the trained mask of prompt 5/16, answer 5/16, user turn 2/16, answer 4/16."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(16, vocab, (length,), generator=g)
    edges = [0, 5 * length // 16, 10 * length // 16, 12 * length // 16, length]
    trained = torch.zeros(length, dtype=torch.bool)
    trained[edges[1]:edges[2]] = True
    trained[edges[3]:] = True
    return ids, trained


def windowed_gradient(ctx: Context, model_dir: Path, adapter_dir: Path, ids: torch.Tensor, trained: torch.Tensor,
                      dtype: torch.dtype, schedules: dict[str, list[int]]) -> dict[str, tuple[float, dict[str, Any]]]:
    """Per schedule (forward window sizes; backward the same, last first): the mean loss and the LoRA grads."""
    from coserve.forward.transformer import Transformer
    from coserve.model.config import ModelConfig
    from coserve.model.weights import load_weights
    from coserve.trainer import TrainableLoRA, WindowedTrainer, train_sequence

    cfg, device = ModelConfig.from_pretrained(model_dir), torch.device(ctx.device)
    model = Transformer(cfg, load_weights(model_dir, cfg, dtype, device), dtype, device)
    out = {}
    for name, windows in schedules.items():
        lora = TrainableLoRA.from_pretrained(adapter_dir, cfg, device)
        state = train_sequence(WindowedTrainer(model, lora), ids, trained, windows)
        grads = {key: p.grad.detach().float() for key, p in lora.named_parameters().items() if p.grad is not None}
        out[name] = (state.loss_sum / state.num_loss_tokens, grads)
    del model
    free_memory()
    return out


def _model(ctx: Context, rec: PartRecord, name: str) -> str:
    sizes = ctx.sizes
    model_dir, adapter_dir = ctx.models.model(name), ctx.models.adapter(name)
    ids, trained = chat_sequence(int(ctx.shapes[name].fields["vocab_size"]), sizes.grad_len, seed=5)
    ref_loss, ref = hf_side.peft_gradient(model_dir, adapter_dir, ids, trained, torch.float32, ctx.device)
    free_memory()
    n = sizes.grad_len // sizes.grad_window
    schedules = {"one window": [sizes.grad_len],
                 f"{n} windows of {sizes.grad_window}": [sizes.grad_window] * n}
    for schedule, (loss, grads) in windowed_gradient(ctx, model_dir, adapter_dir, ids, trained, torch.float32,
                                                     schedules).items():
        tensor, err = hf_side.worst_relative_error(grads, ref)
        rec.details[f"{name}/float32/{schedule}"] = {"worst_tensor": tensor, "rel_err": err, "loss": loss,
                                                     "peft_loss": ref_loss}
        rec.at_most(f"{name} fp32 {schedule}: gradient rel. error", err, FP32_REL_ERR)
        rec.at_most(f"{name} fp32 {schedule}: loss rel. difference", abs(loss - ref_loss) / abs(ref_loss),
                    FP32_LOSS_REL)
    windows = {"windows": schedules[f"{n} windows of {sizes.grad_window}"]}
    _, peft16 = hf_side.peft_gradient(model_dir, adapter_dir, ids, trained, torch.bfloat16, ctx.device)
    free_memory()
    (_, co16), = windowed_gradient(ctx, model_dir, adapter_dir, ids, trained, torch.bfloat16, windows).values()
    _, peft_err = hf_side.worst_relative_error(peft16, ref)
    tensor, err = hf_side.worst_relative_error(co16, ref)
    limit = max(BF16_REL_ERR_FLOOR, 2 * peft_err)
    rec.details[f"{name}/bfloat16"] = {"worst_tensor": tensor, "rel_err": err, "peft_bf16_rel_err": peft_err}
    rec.check(f"{name} bf16 {n} windows of {sizes.grad_window}: gradient rel. error vs the fp32 reference", err,
              f"<= max({BF16_REL_ERR_FLOOR:g}, 2 x peft-bf16's {peft_err:.3g})", err <= limit)
    return f"{name} fp32 {max(rec.details[f'{name}/float32/{s}']['rel_err'] for s in schedules):.2g}, bf16 {err:.2g}"


def run(ctx: Context, rec: PartRecord) -> None:
    exact_fp32()
    parts = [_model(ctx, rec, name) for name in ctx.sizes.grad_models]
    rec.summary = (f"{ctx.sizes.grad_len}-token sequence, windows of {ctx.sizes.grad_window}; worst rel. error: "
                   + "; ".join(parts))
