"""Output logprobs in vLLM's shape: per output token a dict {token_id: `Logprob`} holding the sampled
token first and then the top-N alternatives, each with its decoded text."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.contract.plan import TokenLogprobs
from coserve.frontend.detokenizer import TokenDecoder


@dataclass(slots=True)
class Logprob:
    """One token's log probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per output token: {token_id: Logprob}, holding the sampled token and the top-N alternatives.
SampleLogprobs = list[dict[int, Logprob]]


def to_logprob_dict(lp: TokenLogprobs, tokenizer: TokenDecoder) -> dict[int, Logprob]:
    """vLLM's per-token logprob dict: the sampled token and the top-N alternatives."""
    # The sampled token comes first, as in vLLM, then the alternatives by rank.
    out = {lp.token_id: Logprob(logprob=lp.logprob, rank=lp.rank,
                                decoded_token=tokenizer.decode([lp.token_id]))}
    for i, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs)):
        out.setdefault(tid, Logprob(logprob=value, rank=i + 1, decoded_token=tokenizer.decode([tid])))
    return out
