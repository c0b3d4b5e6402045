"""coserve's side of the parity and attention parts: the offline `LLM` (the native engine) generating
greedily, base and LoRA rows in one batch, with the top log-probs of every step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _gpu_check.context import Context

TOP_LOGPROBS = 5


def make_llm(ctx: Context, model_dir: Path, dtype: str, num_seqs: int, kv_blocks: int, batch_tokens: int) -> Any:
    """The offline LLM on the check's device, its KV cache sized here (not a share of the free memory)."""
    from coserve.offline.llm import LLM

    return LLM(model=str(model_dir), dtype=dtype, device=ctx.device, num_kv_blocks=kv_blocks,
               max_model_len=ctx.sizes.max_model_len, max_num_seqs=num_seqs, max_batch_tokens=batch_tokens,
               enable_prefix_caching=False, max_loras=2, max_lora_rank=ctx.sizes.lora_rank, seed=0)


def greedy(llm: Any, adapter_dir: Path, prompts: list[list[int]], lora_rows: list[bool], tokens: int,
           top: int = TOP_LOGPROBS) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Greedy tokens per row (EOS ignored) and, per step, {token id: log-prob} of the sampled token and the
    `top` most likely ones."""
    from coserve import LoRARequest, SamplingParams

    lora = LoRARequest("gpu-check", 1, str(adapter_dir))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=top)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        lora_request=[lora if m else None for m in lora_rows])
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{tid: lp.logprob for tid, lp in step.items()} for step in (o.outputs[0].logprobs or [])]
                for o in outs]
    return token_ids, logprobs
