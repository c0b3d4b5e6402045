"""Per-row logits processors of the sampler: logit bias, repetition/frequency/presence penalties, min-p.

Each works on the whole batch at once: the rows that use a processor are gathered, their token
histories become one scatter into a `[rows, V]` tensor, and the result is written back. The only Python
loops are over rows (to collect their token ids), never over the vocabulary.

Semantics, as OpenAI and vLLM define them (order as in vLLM's v1 sampler):

1. `logit_bias`: `logits[t] += bias[t]` (OpenAI: -100 bans a token, 100 all but forces it).
2. `repetition_penalty` r (vLLM, CTRL paper): for every token t seen in the prompt or the output so far,
   `logits[t] / r` when positive, `logits[t] * r` otherwise; 1 turns it off.
3. `frequency_penalty` f and `presence_penalty` p (OpenAI): over the output so far,
   `logits[t] -= f * count[t] + p * (count[t] > 0)`; 0 turns them off.
4. After the temperature, `min_p` m (vLLM): tokens whose probability is below `m` times the most likely
   token's are removed; 0 turns it off. Greedy rows are not affected (the argmax always survives).

Steps 1-3 change greedy choices too; logprobs stay those of the raw model distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class ProcessorSettings(Protocol):
    """What a row says about these processors (`coserve.torch_engine.sampler.RowSampling` has it)."""

    logit_bias: dict[int, float] | None
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def needs_processing(row: ProcessorSettings) -> bool:
    """Whether any of steps 1-3 changes this row's logits."""
    return bool(row.logit_bias) or row.repetition_penalty != 1.0 or row.frequency_penalty != 0.0 \
        or row.presence_penalty != 0.0


def process_logits(x: torch.Tensor, rows: Sequence[ProcessorSettings]) -> torch.Tensor:
    """Steps 1-3 on float32 logits `x` `[N, V]`; returns `x` itself when no row asks for them, else a
    new tensor (`x` is left as it was: the logprobs are computed from it)."""
    if not any(needs_processing(r) for r in rows):
        return x
    out = x.clone()
    _add_logit_bias(out, rows)
    _repetition_penalty(out, rows)
    _frequency_presence(out, rows)
    return out


def mask_min_p(scaled: torch.Tensor, rows: Sequence[ProcessorSettings]) -> torch.Tensor:
    """Step 4 on temperature-scaled logits (in place); tokens below `min_p * p_max` become -inf."""
    chosen = [j for j, r in enumerate(rows) if r.min_p > 0.0]
    if not chosen:
        return scaled
    idx = _rows(chosen, scaled.device)
    probs = torch.softmax(scaled[idx], dim=-1)
    min_p = torch.tensor([rows[j].min_p for j in chosen], dtype=probs.dtype, device=scaled.device)
    remove = probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    scaled[idx] = scaled[idx].masked_fill(remove, float("-inf"))
    return scaled


def _rows(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


def _scatter_index(ids: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(local row k, token id) index pairs of every token id in `ids[k]`."""
    local = [k for k, token_ids in enumerate(ids) for _ in token_ids]
    flat = [t for token_ids in ids for t in token_ids]
    return (torch.tensor(local, dtype=torch.long, device=device),
            torch.tensor(flat, dtype=torch.long, device=device))


def _add_logit_bias(x: torch.Tensor, rows: Sequence[ProcessorSettings]) -> None:
    chosen = [j for j, r in enumerate(rows) if r.logit_bias]
    if not chosen:
        return
    biases = [rows[j].logit_bias or {} for j in chosen]
    local, tokens = _scatter_index([list(b) for b in biases], x.device)
    values = torch.tensor([v for b in biases for v in b.values()], dtype=x.dtype, device=x.device)
    row_ids = _rows(chosen, x.device)[local]
    x.index_put_((row_ids, tokens), values, accumulate=True)


def _repetition_penalty(x: torch.Tensor, rows: Sequence[ProcessorSettings]) -> None:
    chosen = [j for j, r in enumerate(rows) if r.repetition_penalty != 1.0]
    if not chosen:
        return
    idx = _rows(chosen, x.device)
    seen = torch.zeros((len(chosen), x.shape[1]), dtype=torch.bool, device=x.device)
    local, tokens = _scatter_index([[*rows[j].prompt_ids, *rows[j].output_ids] for j in chosen], x.device)
    seen[local, tokens] = True
    penalty = torch.tensor([rows[j].repetition_penalty for j in chosen], dtype=x.dtype,
                           device=x.device).unsqueeze(1)
    sub = x[idx]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    x[idx] = torch.where(seen, penalised, sub)


def _frequency_presence(x: torch.Tensor, rows: Sequence[ProcessorSettings]) -> None:
    chosen = [j for j, r in enumerate(rows) if r.frequency_penalty != 0.0 or r.presence_penalty != 0.0]
    if not chosen:
        return
    idx = _rows(chosen, x.device)
    counts = torch.zeros((len(chosen), x.shape[1]), dtype=x.dtype, device=x.device)
    local, tokens = _scatter_index([rows[j].output_ids for j in chosen], x.device)
    counts.index_put_((local, tokens), torch.ones_like(tokens, dtype=x.dtype), accumulate=True)
    freq = torch.tensor([rows[j].frequency_penalty for j in chosen], dtype=x.dtype, device=x.device)
    presence = torch.tensor([rows[j].presence_penalty for j in chosen], dtype=x.dtype, device=x.device)
    x[idx] = x[idx] - freq.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(x.dtype)
