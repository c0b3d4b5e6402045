"""Test helpers: random prompts and reference greedy decoding with transformers/peft."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, prompt: list[int], steps: int
                     ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the raw log-softmax row of each step (EOS is not special here)."""
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    for _ in range(steps):
        row = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
        token = int(row.argmax())
        tokens.append(token)
        logprobs.append(row)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts avoiding the first 8 ids (where the special tokens live)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, vocab_size, (n,), generator=g).tolist() for n in lengths]
