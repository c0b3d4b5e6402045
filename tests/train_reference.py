"""Reference fine-tuning with peft + torch.optim.AdamW, and how trained weights are compared."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from coserve.contract.training_settings import LoRASettings, OptimizerSettings
from coserve.trainer import IGNORE_INDEX, TrainingSequence
from numerics import GRAD_REL_ERR as MAX_REL_ERR  # the derivation: tests/numerics.py


@dataclass
class RefStep:
    """peft + AdamW after one step: weights, the step's pre-clip gradient and its norm."""

    weights: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    norm: float


def peft_adamw_run(model_dir: Path, lora_cfg: LoRASettings, init: dict[str, torch.Tensor],
              batches: list[list[TrainingSequence]], config: OptimizerSettings) -> list[RefStep]:
    """The reference: peft's full-sequence backward, `clip_grad_norm_`, `torch.optim.AdamW`."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_cfg = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.lora_alpha, lora_dropout=0.0,
                          target_modules=list(lora_cfg.target_modules))
    peft_model = get_peft_model(hf, peft_cfg)
    params = {n.replace(".default.weight", ".weight"): p for n, p in peft_model.named_parameters()
              if p.requires_grad}
    assert set(params) == set(init), "peft and the trainer disagree on which tensors train"
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(init[name])
    adamw = torch.optim.AdamW(params.values(), lr=config.learning_rate, betas=config.betas,
                              eps=config.eps, weight_decay=config.weight_decay)
    steps = []
    for batch in batches:
        total = sum(seq.num_trained for seq in batch)
        for seq in batch:
            ignore = torch.full_like(seq.token_ids, IGNORE_INDEX)
            labels = torch.where(seq.trained, seq.token_ids, ignore)
            loss = peft_model(input_ids=seq.token_ids[None], labels=labels[None]).loss
            (loss * seq.num_trained / total).backward()  # HF's loss is the sequence's mean
        grads = {name: p.grad.clone() for name, p in params.items()}
        norm = float(torch.nn.utils.clip_grad_norm_(params.values(), config.max_grad_norm))
        adamw.step()
        adamw.zero_grad()
        steps.append(RefStep({name: p.detach().clone() for name, p in params.items()}, grads, norm))
    return steps


def rel_errs(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor: max |difference| relative to that reference tensor's max |value|."""
    return {name: float((mine[name] - t).abs().max() / t.abs().max()) for name, t in ref.items()}


def worst(errors: dict[str, float]) -> tuple[str, float]:
    name = max(errors, key=errors.get)
    return name, errors[name]


def check_weights(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                   noisy: dict[str, torch.Tensor], bound: float) -> None:
    """Weights within MAX_REL_ERR, except elements whose step follows gradient noise (`noisy`).

    Adam's step is about lr * g / |g| per element: where |g| is ~1e-5 of its tensor's largest, the
    1e-6-level rounding differences between two exact backwards (fp32, other summation orders) move
    that element's step by a visible fraction of lr. Those few are only held to Adam's bound.
    """
    for name, w_ref in ref.items():
        diff, scale = (mine[name] - w_ref).abs(), float(w_ref.abs().max())
        clean = float(diff[~noisy[name]].max()) / scale
        assert clean <= MAX_REL_ERR, f"{name}: relative error {clean:.2e}"
        if noisy[name].any():
            assert float(diff[noisy[name]].max()) <= bound, f"{name}: beyond Adam's step bound"
