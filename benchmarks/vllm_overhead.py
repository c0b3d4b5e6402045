"""coserve's scheduling overhead on vLLM: vLLM alone vs `LLM(..., engine="vllm")` with no job (issue 18).

One offline workload (greedy, `--prompts` prompts of 32-160 random tokens, `--max-tokens` outputs each,
no EOS stop) through:

* **vLLM alone**: `vllm.LLM.generate`, vLLM's own scheduler, the settings `VllmEngine` gives vLLM
  (in-process engine core, eager, chunked prefill, prefix caching, LoRA enabled, same batch limits);
* **coserve on vLLM**: `coserve.LLM(engine="vllm").generate`, coserve's scheduler planning every step
  (its `EngineCore`, admission, chunking) and vLLM executing it through the step API.

Both engines live in this process; the arms alternate, `--repeats` times each, and the best run of
each is kept (a burst of load from another process on the shared machine only slows a run down).
Target: coserve on vLLM within 10% of vLLM alone (output tokens/s).

    .venv/bin/python benchmarks/vllm_overhead.py --model ~/.cache/coserve/models/smollm2-135m-instruct \
        [--prompts 32] [--max-tokens 64] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path


def _workload(vocab: int, prompts: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 160))] for _ in range(prompts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from coserve import LLM, SamplingParams
    from coserve.vllm.backend import VllmRuntime, VllmSettings

    ours = LLM(model=args.model, engine="vllm", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
               max_batch_tokens=args.max_batch_tokens, kv_cache_memory_gb=args.kv_cache_gb,
               max_model_len=args.max_model_len)
    # vLLM alone, built exactly as VllmEngine builds it (same kwargs), driven by its own scheduler.
    alone = VllmRuntime(VllmSettings(model=args.model, dtype=args.dtype, device="cpu",
                                     max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens,
                                     max_loras=4, max_lora_rank=64, max_model_len=args.max_model_len,
                                     kv_cache_memory_gb=args.kv_cache_gb,
                                     gpu_memory_utilization=0.9, seed=args.seed))
    alone.restore_scheduling()  # vLLM's scheduler decides every chunk (no coserve plan)
    from vllm.inputs import TokensPrompt

    import vllm

    prompts = _workload(ours.engine.model_config.vocab_size, args.prompts, args.seed)
    ours_params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # Detokenized, as vLLM does by default (coserve detokenizes its outputs too).
    vllm_params = vllm.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def run_ours() -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = ours.generate([{"prompt_token_ids": p} for p in prompts], ours_params)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

    def run_alone() -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = alone.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], vllm_params,
                                  use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    run_ours(), run_alone()  # warm-up
    best = {"vllm": float("inf"), "coserve-on-vllm": float("inf")}
    same = True
    for _ in range(args.repeats):
        for name, fn in (("vllm", run_alone), ("coserve-on-vllm", run_ours)):
            seconds, tokens = fn()
            print(f"{name}: {seconds:.2f} s", flush=True)
            best[name] = min(best[name], seconds)
            if name == "vllm":
                reference = tokens
            else:
                same &= tokens == reference
    total = args.prompts * args.max_tokens
    result = {
        "model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs, "max_batch_tokens": args.max_batch_tokens,
        "output_tokens_per_s": {k: total / v for k, v in best.items()},
        "overhead": best["coserve-on-vllm"] / best["vllm"] - 1.0, "identical_greedy_outputs": same,
        "machine": f"{platform.machine()} x{os.cpu_count()}, load {os.getloadavg()[0]:.1f} at the end",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
