"""Sampling of the next token for a batch of logits rows.

One `Sampler` call turns `[N, V]` logits into N token ids (and, for the rows that ask, their logprobs).
Every row carries its own `RowSampling` (temperature, top-k, top-p, seed, logprobs), and the work is
batched over rows; the only per-row Python loop is the re-seeding of seeded rows.

Semantics (documented because callers and tests rely on them):

- **Greedy** (`temperature == 0`): `argmax` of the raw logits. On ties torch's `argmax` returns the
  lowest index, so greedy ties resolve to the smallest token id.
- **Random**: logits are divided by the temperature (clamped to `MIN_TEMPERATURE` so a tiny positive
  temperature cannot overflow float32), then top-k keeps the k most likely tokens and top-p keeps the
  smallest prefix of the (top-k renormalised) distribution whose cumulative probability is >= top_p;
  the most likely token is always kept. The token is then drawn by the exponential race:
  `argmax(probs / q)` with `q ~ Exp(1)` i.i.d., which samples exactly from `probs`.
- **Seeds**: a seeded row draws its `q` from a generator seeded with `mix_seed(seed, output_index)`, so
  its tokens depend only on its own logits, seed and output position: not on the other rows of the
  batch, nor on whether the request was preempted and recomputed. Streams differ between CPU and CUDA.
  Unseeded rows draw from torch's default generator in one batched call.
- **Logits processors** (`coserve.torch_engine.logits_processors`): logit bias and the repetition,
  frequency and presence penalties change the logits before the greedy or random choice; min-p masks
  after the temperature, before top-k/top-p.
- **Token masks** (`coserve.torch_engine.token_mask`, structured output): tokens a row's grammar forbids
  get -inf after the logits processors, before the greedy or random choice, so every sampled token is
  allowed; unmasked rows are untouched (one `masked_fill` over the masked rows).
- **Logprobs** are those of the raw model distribution, `log_softmax(logits)` in float32, before
  the mask, temperature, top-k and top-p (vLLM's default "raw_logprobs"): under a grammar,
  `top_logprobs` can list tokens the grammar forbade. `rank` is 1 + the number of tokens
  with a strictly larger logprob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coserve.contract.plan import TokenLogprobs
from coserve.torch_engine.logits_processors import mask_min_p, process_logits
from coserve.torch_engine.token_mask import TokenMask, apply_token_mask

# Below this a positive temperature is clamped: logits / 1e-5 stays far inside float32's range, and
# the distribution is already a point mass on the argmax for any realistic logit gap.
MIN_TEMPERATURE = 1e-5
# A float32 cumulative sum that lands within this of top_p counts as reaching it; without it, e.g.
# 0.5 + 0.3 rounding to 0.79999995 would keep a third token for top_p = 0.8.
TOP_P_EPS = 1e-6
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class RowSampling:
    """How to sample one row of logits.

    Args:
        temperature: 0 means greedy.
        top_p: nucleus mass kept, in (0, 1]; 1 turns it off.
        top_k: keep the k most likely tokens; -1 (or 0) turns it off; k >= V is also off.
        seed: per-request seed, or None for the default generator.
        output_index: index of the output token being sampled (0 for the first one).
        num_logprobs: None for no logprobs, 0 for the sampled token's only, N for the top-N as well.
        logit_bias, repetition_penalty, frequency_penalty, presence_penalty, min_p: see
            `coserve.torch_engine.logits_processors` (the defaults turn them off).
        prompt_ids / output_ids: the sequence's tokens so far (needed by the penalties only).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    output_index: int = 0
    num_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _splitmix64(x: int) -> int:
    """One SplitMix64 step: a cheap bijective 64-bit mixer with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, output_index: int) -> int:
    """Generator seed for output token `output_index` of a request seeded with `seed` (63 bits).

    Mixing (rather than e.g. `seed + output_index`) keeps neighbouring seeds from sharing streams
    shifted by one token. 63 bits keep the value a valid non-negative int64 for `manual_seed`.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (output_index & _MASK64)) >> 1


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


class Sampler:
    """Samples one token per logits row; see the module docstring for the exact semantics."""

    def __init__(self) -> None:
        # One generator per device, re-seeded per seeded row: constructing generators is not free
        # (a CUDA generator allocates state), re-seeding is a host-side assignment.
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, rows: list[RowSampling], mask: TokenMask | None = None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample `logits[i]` according to `rows[i]`.

        Args:
            logits: `[N, V]`, any float dtype and device; computed in float32. Not modified.
            rows: N sampling settings, in row order.
            mask: the tokens some rows may sample (each of those rows must allow at least one).

        Returns:
            The N sampled token ids, and per row a `TokenLogprobs` (or None where not asked).
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        if not rows:
            return [], []
        x = logits.detach().float()
        processed = process_logits(x, rows)  # x itself when no row asks: logprobs stay raw
        if mask is not None and mask.rows:
            if processed is x:
                processed = x.clone()
            apply_token_mask(processed, mask)
        n, device = len(rows), x.device
        greedy = [i for i, r in enumerate(rows) if r.greedy]
        random = [i for i, r in enumerate(rows) if not r.greedy]
        if len(greedy) == n:
            tokens = processed.argmax(dim=-1)
        elif len(random) == n:
            tokens = self._sample_random(processed, rows)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=device)
            g_idx, r_idx = _index(greedy, device), _index(random, device)
            tokens[g_idx] = processed[g_idx].argmax(dim=-1)
            tokens[r_idx] = self._sample_random(processed[r_idx], [rows[i] for i in random])
        return tokens.tolist(), self._logprobs(x, tokens, rows)

    def _sample_random(self, x: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
        """Temperature, top-k/top-p masking and the exponential race for non-greedy rows."""
        temps = [max(r.temperature, MIN_TEMPERATURE) for r in rows]
        scaled = x / torch.tensor(temps, dtype=torch.float32, device=x.device).unsqueeze(1)
        scaled = _mask_top_k_top_p(mask_min_p(scaled, rows), rows)
        probs = torch.softmax(scaled, dim=-1)
        q = self._exponentials(probs.shape, rows, x.device)
        # argmax_i p_i / q_i is distributed as p (Exp(1) race); masked tokens have p_i = 0 and lose.
        return (probs / q).argmax(dim=-1)

    def _exponentials(
        self, shape: torch.Size, rows: list[RowSampling], device: torch.device
    ) -> torch.Tensor:
        """`Exp(1)` noise per row: batched for unseeded rows, per-row generator for seeded ones."""
        q = torch.empty(shape, dtype=torch.float32, device=device)
        seeded = {j: (r.seed, r.output_index) for j, r in enumerate(rows) if r.seed is not None}
        if not seeded:
            q.exponential_()
        elif len(seeded) < len(rows):
            unseeded = [j for j, r in enumerate(rows) if r.seed is None]
            q[_index(unseeded, device)] = torch.empty(
                (len(unseeded), shape[1]), dtype=torch.float32, device=device
            ).exponential_()
        if seeded:
            gen = self._generator(device)
            for j, (seed, output_index) in seeded.items():
                gen.manual_seed(mix_seed(seed, output_index))
                # A whole contiguous row of size V from a freshly seeded generator: the same draws
                # whatever the batch looks like.
                q[j].exponential_(generator=gen)
        # q == 0 would give 0/0 = NaN on masked tokens, and argmax treats NaN as the maximum.
        return q.clamp_min_(torch.finfo(torch.float32).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen

    def _logprobs(
        self, x: torch.Tensor, tokens: torch.Tensor, rows: list[RowSampling]
    ) -> list[TokenLogprobs | None]:
        """Raw-distribution logprobs, computed only for the rows that asked (batched over them)."""
        out: list[TokenLogprobs | None] = [None] * len(rows)
        want = {i: r.num_logprobs for i, r in enumerate(rows) if r.num_logprobs is not None}  # row -> count
        if not want:
            return out
        vocab = x.shape[1]
        if len(want) == len(rows):
            lp, tok = torch.log_softmax(x, dim=-1), tokens
        else:
            idx = _index(list(want), x.device)
            lp, tok = torch.log_softmax(x[idx], dim=-1), tokens[idx]
        chosen = lp.gather(1, tok.unsqueeze(1))
        ranks = (lp > chosen).sum(dim=-1) + 1
        top_n = min(max(want.values()), vocab)
        top_vals: list[list[float]] = [[] for _ in want]
        top_ids: list[list[int]] = [[] for _ in want]
        if top_n > 0:
            vals, ids = lp.topk(top_n, dim=-1)  # sorted, most likely first
            top_vals, top_ids = vals.tolist(), ids.tolist()
        chosen_l, ranks_l, tok_l = chosen.squeeze(1).tolist(), ranks.tolist(), tok.tolist()
        for j, (i, num_logprobs) in enumerate(want.items()):
            k = min(num_logprobs, vocab)
            out[i] = TokenLogprobs(
                token_id=tok_l[j], logprob=chosen_l[j], rank=ranks_l[j],
                top_token_ids=top_ids[j][:k], top_logprobs=top_vals[j][:k],
            )
        return out


def _mask_top_k_top_p(scaled: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (sort-based, batched).

    Only rows with an active top-k (< V) or top-p (< 1) are sorted; the others are returned untouched.
    `scaled` is a fresh tensor owned by the caller and is updated in place for partial batches.
    """
    vocab = scaled.shape[1]
    masked = [j for j, r in enumerate(rows) if 0 < r.top_k < vocab or r.top_p < 1.0]
    if not masked:
        return scaled
    sub = scaled if len(masked) == len(rows) else scaled[_index(masked, scaled.device)]
    device = scaled.device
    ks = [rows[j].top_k if 0 < rows[j].top_k < vocab else vocab for j in masked]
    ps = [rows[j].top_p for j in masked]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=device).unsqueeze(0)
    # Top-k by position in the sorted order: exactly k tokens survive even with tied logits.
    remove = positions >= torch.tensor(ks, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if min(ps) < 1.0:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # renormalised after top-k
        # Mass strictly before each position (shifted cumsum, exact zero at position 0). A token is
        # kept while the tokens before it have not yet reached top_p: the smallest set with mass
        # >= top_p. Rows with top_p = 1 get a threshold above any mass so rounding removes nothing.
        before = torch.cumsum(sorted_probs, dim=-1)
        before = torch.cat([torch.zeros_like(before[:, :1]), before[:, :-1]], dim=-1)
        thresholds = torch.tensor([p - TOP_P_EPS if p < 1.0 else 2.0 for p in ps], device=device)
        remove_p = before >= thresholds.unsqueeze(1)
        remove_p[:, 0] = False  # the most likely token always survives, whatever top_p is
        sorted_logits = sorted_logits.masked_fill(remove_p, float("-inf"))
    sub = torch.empty_like(sub).scatter_(1, order, sorted_logits)
    if len(masked) == len(rows):
        return sub
    scaled[_index(masked, device)] = sub
    return scaled
