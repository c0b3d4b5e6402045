"""What a server's KV cache must hold at start: one `--max-model-len` sequence beside one fine-tuning
forward window (a job's sequence keeps its K/V in the same cache while it trains). A cache that holds
less is refused at start, with what fits and which flag to change, for either engine: coserve's own
(whose cache is sized from `--kv-cache-memory-gb` or `--gpu-memory-utilization`) and vLLM's (which checks
`max_model_len` alone; this check asks for the window too, counted in the blocks vLLM reports).
"""

from __future__ import annotations

from coserve.contract import defaults
from coserve.contract.engine import EngineStartError, RuntimeLayout


class KvCacheTooSmall(EngineStartError):
    """The KV cache cannot hold one `max_model_len` sequence plus one fine-tuning window."""


def kv_capacity_refusal(cache_tokens: int, max_model_len: int,
                        window_tokens: int = defaults.FINETUNE_WINDOW_TOKENS) -> str | None:
    """Why a cache of `cache_tokens` token positions is too small (None: it is large enough).

    The message says what fits (the tokens the cache holds, the tokens needed) and which flag to change.
    """
    needed = max_model_len + window_tokens
    if cache_tokens >= needed:
        return None
    fits = cache_tokens - window_tokens
    shorter = (f", or lower --max-model-len to at most {fits}" if fits >= 1 else
               ": no --max-model-len fits beside a fine-tuning window")
    return (f"the KV cache holds {cache_tokens} tokens, and serving needs at least {needed}: one sequence of "
            f"--max-model-len {max_model_len} plus one fine-tuning window of {window_tokens} tokens. Raise "
            f"--kv-cache-memory-gb (or --gpu-memory-utilization on CUDA){shorter}")


def check_kv_capacity(layout: RuntimeLayout, window_tokens: int = defaults.FINETUNE_WINDOW_TOKENS) -> None:
    """Check an engine's layout at start.

    Raises:
        KvCacheTooSmall: its cache holds less than one `max_model_len` sequence plus one window.
    """
    refusal = kv_capacity_refusal(layout.num_kv_blocks * layout.block_size, layout.max_model_len, window_tokens)
    if refusal is not None:
        raise KvCacheTooSmall(refusal)
