"""The references: transformers (+ peft) on the same device, loaded from the same folders as coserve.

`greedy_logprobs`: one left-padded batched `generate`, base and LoRA rows mixed through peft's
`adapter_names`, returning the greedy tokens and every step's log-softmax. `peft_gradient`: peft's
full-sequence backward of the mean cross-entropy over the trained tokens (HF labels -100 elsewhere),
the reference the windowed trainer must reproduce.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ADAPTER = "gpu-check"
IGNORE_INDEX = -100


def load(model_dir: Path, dtype: torch.dtype, device: str, adapter_dir: Path | None = None,
         trainable: bool = False) -> Any:
    """The HF model in `dtype` on `device`, wrapped by peft with the adapter when one is given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=ADAPTER, is_trainable=trainable)
    return model.train() if trainable else model.eval()


def greedy_logprobs(model: Any, prompts: list[list[int]], lora_rows: list[bool], tokens: int,
                    pad_id: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens ([rows][tokens], EOS not special) and log-softmax of every step ([rows, tokens,
    vocab], float32, on the CPU)."""
    from transformers import GenerationConfig

    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    config = GenerationConfig(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
                              pad_token_id=pad_id, bos_token_id=None, output_logits=True,
                              return_dict_in_generate=True)
    names = {"adapter_names": [ADAPTER if m else "__base__" for m in lora_rows]} if any(lora_rows) else {}
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             **names)
    logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1).cpu()
    return [row[width:].tolist() for row in out.sequences], logprobs


def peft_gradient(model_dir: Path, adapter_dir: Path, token_ids: torch.Tensor, trained: torch.Tensor,
                  dtype: torch.dtype, device: str) -> tuple[float, dict[str, torch.Tensor]]:
    """peft's loss and LoRA gradients (float32, keyed like `TrainableLoRA.named_parameters`) of one sequence."""
    model = load(model_dir, dtype, device, adapter_dir, trainable=True)
    ids, mask = token_ids.to(device), trained.to(device)
    labels = torch.where(mask, ids, torch.full_like(ids, IGNORE_INDEX))
    loss = model(input_ids=ids[None], labels=labels[None]).loss  # the mean over the trained tokens
    loss.backward()
    grads = {name.replace(f".{ADAPTER}.weight", ".weight"): p.grad.detach().float()
             for name, p in model.named_parameters() if "lora_" in name and p.grad is not None}
    value = float(loss.detach())
    del model, loss
    return value, grads


def worst_relative_error(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The tensor with the largest max |difference| relative to its reference's max |value|, and that error."""
    if set(mine) != set(ref):
        raise ValueError(f"the gradients name different tensors: {sorted(set(mine) ^ set(ref))[:4]}")
    errors = {name: float((mine[name].to(t.device).float() - t).abs().max() / t.abs().max().clamp_min(1e-30))
              for name, t in ref.items()}
    name = max(errors, key=lambda k: errors[k])
    return name, errors[name]
