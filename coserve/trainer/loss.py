"""The loss of one forward window: the target tokens' log-probs (chunked cross-entropy) and the loss's
gradient w.r.t. the hidden state (the loss itself comes from `coserve.trainer.token_losses`).

For large windows or vocabularies the full [tokens, vocab] logits are never materialised. The
vocabulary is walked in chunks with an online log-sum-exp (as flash attention does over keys): for
each chunk the running maximum, the running sum of exponentials and the running `softmax @ W`
product are rescaled and extended, so the loss and d(loss)/d(normed hidden) = softmax @ W - W[target]
come out of one pass over the LM head, with [tokens, chunk] as the largest temporary.

When the head is float32 and a row of logits fits `FULL_LOGITS_MAX_ELEMENTS`, `full_cross_entropy`
computes blocks of whole rows in one matmul each through the model's own head kernels instead, with
at most `FULL_LOGITS_MAX_ELEMENTS` logits alive at once (4 MiB: 128 tokens at an 8k vocabulary;
never the window's, let alone the sequence's, full logits): a window riding along a decode batch has a
few tokens, and on CPU the chunked path's generic matmuls made its loss cost 4.3 ms for 4 tokens of
the small preset (about 2 ms in one pass with oneDNN, and 45 -> 25 ms for 256 tokens with the exp
floor below).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from coserve.forward.transformer import Transformer, rms_norm
from coserve.trainer.token_losses import CrossEntropy, TokenLoss

IGNORE_INDEX = -100  # a position without a target, as in HF labels
DEFAULT_VOCAB_CHUNK = 4096
FULL_LOGITS_MAX_ELEMENTS = 1 << 20  # 4 MiB of float32 logits per block: 128 tokens at an 8k vocabulary
# exp() of arguments below about -87 underflows float32 (to denormals or 0), which CPU vector units
# take 10-15x longer on: logits spread over 100+ (as peaked models' are) made the loss of a
# 256-token window 48 ms instead of 25. Clamping there changes a probability by < 1.7e-38.
EXP_FLOOR = -87.0


@dataclass(slots=True)
class WindowLoss:
    """The loss of a window's trained positions and the gradient handed to the backward."""

    loss_sum: float  # sum of the loss's per-token terms (unscaled; cross-entropy: the token NLLs)
    num_tokens: int  # trained positions in the window
    grad_hidden: torch.Tensor  # [window, hidden] fp32: scale * d(loss_sum)/d(last hidden state)
    positions: torch.Tensor  # [num_tokens] the trained positions, relative to the window's start
    logprobs: torch.Tensor  # [num_tokens] fp32: log-prob of each trained position's target


def chunked_cross_entropy(normed: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor,
                          chunk: int = DEFAULT_VOCAB_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy of `normed @ lm_head.T` and its gradient w.r.t. `normed`.

    Args:
        normed: [n, hidden] final-normed hidden states (every row has a target).
        lm_head: [vocab, hidden] in the model dtype.
        targets: [n] target token ids.
    Returns:
        (loss [n] fp32, grad [n, hidden] fp32) where grad is d(sum of loss)/d(normed).
    """
    n, hidden = normed.shape
    device = normed.device
    running_max = torch.full((n,), float("-inf"), device=device)
    running_sum = torch.zeros(n, device=device)
    weighted = torch.zeros(n, hidden, device=device)  # sum over vocab of exp(z - max) * W[v]
    target_logit = torch.zeros(n, device=device)
    for lo in range(0, lm_head.shape[0], chunk):
        w = lm_head[lo: lo + chunk]
        # The same matmul-then-cast as `Transformer.logits`, so bf16 losses match the serving path.
        z = F.linear(normed, w).float()  # [n, c]
        hit = (targets >= lo) & (targets < lo + w.shape[0])
        picked = z.gather(1, (targets - lo).clamp(0, w.shape[0] - 1).unsqueeze(1)).squeeze(1)
        target_logit += torch.where(hit, picked, torch.zeros_like(picked))
        new_max = torch.maximum(running_max, z.amax(dim=1))
        rescale = torch.exp(running_max - new_max)  # exp(-inf) = 0 on the first chunk
        p = torch.exp((z - new_max.unsqueeze(1)).clamp_(min=EXP_FLOOR))
        running_sum = running_sum * rescale + p.sum(dim=1)
        weighted = weighted * rescale.unsqueeze(1) + p @ w.float()
        running_max = new_max
    loss = running_max + torch.log(running_sum) - target_logit
    grad = weighted / running_sum.unsqueeze(1) - lm_head[targets].float()
    return loss, grad


def full_cross_entropy(model: Transformer, normed: torch.Tensor,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_cross_entropy` in one pass over the vocabulary, with `model`'s LM head kernels.

    Returns (loss [n] fp32, grad [n, hidden] fp32), grad = softmax @ W - W[target].
    """
    z = model.head_logits(normed)  # [n, vocab] fp32
    target_logit = z.gather(1, targets.unsqueeze(1))
    top = z.amax(dim=1, keepdim=True)
    exps = z.sub_(top).clamp_(min=EXP_FLOOR).exp_()  # in place: one [n, vocab] buffer in all
    total = exps.sum(dim=1, keepdim=True)
    loss = (top + torch.log(total) - target_logit).squeeze(1)
    # Normalised after the matmul: exps / total would be denormal where exps is near the floor.
    grad = model.head_input_grad(exps).div_(total) - model.weights.lm_head[targets].float()
    return loss, grad


def window_loss(model: Transformer, hidden: torch.Tensor, targets: torch.Tensor, scale: float,
                chunk: int = DEFAULT_VOCAB_CHUNK, loss: TokenLoss | None = None,
                start: int = 0) -> WindowLoss:
    """The window's trained positions' loss and `scale` x its gradient.

    Args:
        hidden: [s, hidden] states after the last layer (before the final norm) of the window.
        targets: [s] next-token targets from the *whole* sequence, IGNORE_INDEX where untrained.
        scale: the normalisation of the gradient (1 / trained tokens of the sequence or batch).
        loss: the loss over the target log-probs (default: cross-entropy, weight 1).
        start: the window's first position in its sequence (the loss's per-token inputs are the
            sequence's: position p's target is token p + 1).
    """
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    if rows.numel() == 0:
        empty = torch.zeros(0, device=hidden.device)
        return WindowLoss(0.0, 0, grad_hidden, rows, empty)
    with torch.enable_grad():
        h = hidden[rows].detach().requires_grad_()
        normed = rms_norm(h, model.weights.final_norm, model.cfg.rms_norm_eps)
    nll, grad_nll = _target_nll(model, normed.detach(), targets[rows], chunk)
    logprobs = -nll
    terms = (loss or CrossEntropy()).terms(rows + start + 1, logprobs)
    # d(loss)/d(normed) = d(loss)/d(logprob) * d(logprob)/d(normed), and d(logprob) = -d(nll).
    grad_normed = grad_nll * (-terms.dlogprob * scale).unsqueeze(1)
    # Back through the final norm only (a few [n, hidden] ops); the LM head part is already done.
    (grad_h,) = torch.autograd.grad(normed, h, grad_normed.to(normed.dtype))
    grad_hidden[rows] = grad_h.float()
    return WindowLoss(float(terms.loss.sum()), int(rows.numel()), grad_hidden, rows, logprobs)


def _target_nll(model: Transformer, normed: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of the targets and its gradient w.r.t. `normed` (one-pass blocks of whole
    rows when the head is float32, the chunked walk over the vocabulary otherwise)."""
    head = model.weights.lm_head
    block = FULL_LOGITS_MAX_ELEMENTS // head.shape[0]  # whole rows of logits per one-pass block
    if head.dtype != torch.float32 or block < 1:
        return chunked_cross_entropy(normed, head, targets, chunk)
    parts = [full_cross_entropy(model, normed[lo: lo + block], targets[lo: lo + block])
             for lo in range(0, normed.shape[0], block)]
    if len(parts) == 1:  # the usual window (a few tokens next to decodes): no copy
        return parts[0]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
