"""Helpers and per-engine arms of ``benchmarks/engine_throughput.py``.

Each arm runs in its own subprocess (``python _bench_arms.py ARM --spec SPEC --out OUT``) so that
memory, OpenMP threads and imported libraries of one engine do not disturb another; the ``paired``
arm runs coserve and transformers in one process with their timed calls alternating, so that the
drift of a shared machine cancels out of their ratio.  The vLLM arm runs
under ``.vllm-venv/bin/python``, so this module imports nothing but the standard library at top level;
every engine import happens inside its arm.

The spec (JSON written by the driver) holds: ``model_dir``, ``adapter_dir``, ``prompts`` (token-id
lists), ``lora_mask`` (one bool per prompt), ``max_tokens``, ``threads``, ``warmup`` (prompts),
``warmup_tokens``, ``max_num_seqs``, ``max_batch_tokens`` and, for the memory check,
``memory_iterations``; optionally ``dtype`` and ``device`` (default ``float32`` on the CPU) and
``num_kv_blocks`` (coserve's KV cache; default: the engine's own sizing).  The result (JSON) holds
``tokens_per_s``, ``wall_s``, ``peak_rss_mib``, ``outputs`` (generated token ids per prompt) and
arm-specific notes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _bench_memory import Runner, coserve_memory_check, count_engine_steps  # noqa: E402

ADAPTER_NAME = "bench-lora"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ----------------------------------------------------------------------------- measurements
def peak_rss_mib() -> float:
    """Peak resident set size of this process (and of any waited-for children), in MiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024.0


def timed(fn: Callable[[], Any], repeats: int = 1) -> tuple[Any, list[float]]:
    """Run ``fn`` ``repeats`` times; return the last result and every call's wall seconds."""
    walls, result = [], None
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        result = fn()
        walls.append(time.perf_counter() - start)
    return result, walls


def finish(spec: dict[str, Any], outputs: list[list[int]], walls: list[float],
           **extra: Any) -> dict[str, Any]:
    """Assemble an arm's result: throughput (median and best timed call), peak RSS, outputs, notes."""
    n_tokens = sum(len(o) for o in outputs)
    expected = len(spec["prompts"]) * spec["max_tokens"]
    median = sorted(walls)[len(walls) // 2]
    return {"tokens_per_s": expected / median, "best_tokens_per_s": expected / min(walls),
            "wall_s": median, "walls_s": walls, "output_tokens": n_tokens, "expected_tokens": expected,
            "peak_rss_mib": peak_rss_mib(), "loadavg_1m_after": os.getloadavg()[0],
            "outputs": outputs, **extra}


def set_torch_threads(threads: int) -> None:
    """Pin torch's intra-op thread count (the arms' subprocesses also get OMP_NUM_THREADS)."""
    import torch

    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- workload preparation
def special_token_ids(model_dir: Path) -> set[int]:
    """Ids to keep out of random prompts: the tokenizer's special tokens and config bos/eos/pad."""
    ids: set[int] = set()
    cfg = json.loads((model_dir / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        val = cfg.get(key)
        ids.update(val if isinstance(val, list) else [] if val is None else [val])
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        ids.update(tok.all_special_ids)
        ids.update(getattr(tok, "added_tokens_decoder", {}).keys())
    except Exception as exc:  # noqa: BLE001 - a model without tokenizer still benchmarks
        print(f"[bench] no tokenizer in {model_dir} ({exc}); avoiding config ids only", file=sys.stderr)
    return ids


def make_prompts(model_dir: Path, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``lo..hi`` token ids drawn with ``seed`` from the vocab minus special ids."""
    import random

    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    banned = special_token_ids(model_dir)
    allowed = [i for i in range(vocab) if i not in banned]
    rng = random.Random(seed)
    return [[rng.choice(allowed) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_adapter(model_dir: Path, out: Path, rank: int = 16, alpha: int = 32, seed: int = 0,
                 b_std: float = 0.02) -> Path:
    """Save a PEFT LoRA adapter (all seven projections) whose B matrices are random, not zero."""
    from coserve.model.tiny_model import create_random_adapter

    return create_random_adapter(model_dir, out, seed=seed, b_std=b_std, r=rank, lora_alpha=alpha,
                                 lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none",
                                 task_type="CAUSAL_LM")


def warmup_slice(spec: dict[str, Any]) -> tuple[list[list[int]], list[bool]]:
    """The warm-up prompts (distinct from the timed ones, so no prefix-cache hit) and their mask."""
    prompts, lora = spec["warmup"], any(spec["lora_mask"])
    return prompts, [lora and i % 2 == 1 for i in range(len(prompts))]


# ----------------------------------------------------------------------------- arms
def coserve_runner(spec: dict[str, Any]) -> tuple[Runner, Any]:
    """coserve's offline ``LLM.generate`` with a per-prompt ``lora_request`` list, and the LLM."""
    set_torch_threads(spec["threads"])
    from coserve import LLM, LoRARequest, SamplingParams

    # Prefix caching off (here and in vLLM): the workload has no shared prefixes, and a repeated
    # timed call with the same prompts would otherwise skip its prefill.
    llm = LLM(model=spec["model_dir"], dtype=spec.get("dtype", "float32"), device=spec.get("device", "cpu"),
              enable_prefix_caching=False, num_kv_blocks=spec.get("num_kv_blocks"),
              max_num_seqs=spec["max_num_seqs"], max_batch_tokens=spec["max_batch_tokens"])
    lora = LoRARequest(ADAPTER_NAME, 1, spec["adapter_dir"])

    def run(prompts: list[list[int]], mask: list[bool], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        reqs = [lora if m else None for m in mask]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=reqs)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run, llm


def arm_coserve(spec: dict[str, Any]) -> dict[str, Any]:
    """coserve alone: warm-up, timed calls, then the memory check if asked."""
    run, llm = coserve_runner(spec)
    steps = count_engine_steps(llm)
    run(*warmup_slice(spec), spec["warmup_tokens"])
    steps0 = steps[0]
    outputs, walls = timed(lambda: run(spec["prompts"], spec["lora_mask"], spec["max_tokens"]),
                          spec["repeats"])
    result = finish(spec, outputs, walls, engine_iterations=steps[0] - steps0)
    if spec.get("memory_iterations"):
        result["memory"] = coserve_memory_check(run, spec, steps)
    return result


def hf_runner(spec: dict[str, Any]) -> tuple[Runner, dict[str, Any]]:
    """transformers ``generate`` on one left-padded batch; LoRA rows via peft ``adapter_names``."""
    set_torch_threads(spec["threads"])
    import peft
    import torch
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = torch.device(spec.get("device", "cpu"))
    dtype = getattr(torch, spec.get("dtype", "float32"))
    base = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).to(device).eval()
    lora = any(spec["lora_mask"])  # a base-only workload runs the plain model, without peft
    model = PeftModel.from_pretrained(base, spec["adapter_dir"], adapter_name=ADAPTER_NAME).eval() if lora else base
    pad_id = base.config.pad_token_id if base.config.pad_token_id is not None else 0
    # eos disabled (vLLM's ignore_eos semantics: EOS may be sampled, it just does not stop).
    # min_new_tokens == max_new_tokens guards the length; without an eos id it masks nothing.
    gcfg = GenerationConfig(do_sample=False, max_new_tokens=spec["max_tokens"],
                            min_new_tokens=spec["max_tokens"], eos_token_id=None,
                            pad_token_id=pad_id, bos_token_id=None)

    def run(prompts: list[list[int]], lmask: list[bool], max_tokens: int) -> list[list[int]]:
        gcfg.max_new_tokens = gcfg.min_new_tokens = max_tokens
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            attn[row, width - len(p):] = 1
        names = {"adapter_names": [ADAPTER_NAME if m else "__base__" for m in lmask]} if lora else {}
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                 generation_config=gcfg, **names)
        return [row[width:].tolist() for row in out]

    extra = {"lora_mode": "mixed-batch (peft adapter_names)" if lora else "none (base model)",
             "lora_logit_max_abs_delta": lora_logit_delta(model, spec["prompts"][0]) if lora else None,
             "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                          "peft": peft.__version__}}
    return run, extra


def arm_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers alone: warm-up, then the timed calls."""
    run, extra = hf_runner(spec)
    run(*warmup_slice(spec), spec["warmup_tokens"])
    outputs, walls = timed(lambda: run(spec["prompts"], spec["lora_mask"], spec["max_tokens"]),
                          spec["repeats"])
    return finish(spec, outputs, walls, **extra)


def arm_paired(spec: dict[str, Any]) -> dict[str, Any]:
    """coserve and transformers in one process, their timed calls alternating.

    A shared machine drifts by tens of percent within minutes; a ratio of two calls made seconds
    apart is far steadier than one of two runs made minutes apart. Peak RSS covers both engines.
    """
    co_run, llm = coserve_runner(spec)
    hf_run, extra = hf_runner(spec)
    steps = count_engine_steps(llm)
    for run in (co_run, hf_run):
        run(*warmup_slice(spec), spec["warmup_tokens"])
    args = (spec["prompts"], spec["lora_mask"], spec["max_tokens"])
    co_walls, hf_walls, steps0 = [], [], steps[0]
    for _ in range(max(1, spec["repeats"])):
        co_out, walls = timed(lambda: co_run(*args))
        co_walls += walls
        hf_out, walls = timed(lambda: hf_run(*args))
        hf_walls += walls
    co = finish(spec, co_out, co_walls,
                engine_iterations=(steps[0] - steps0) // len(co_walls))
    if spec.get("memory_iterations"):
        co["memory"] = coserve_memory_check(co_run, spec, steps)
    return {"coserve": co, "hf": finish(spec, hf_out, hf_walls, **extra),
            "pair_ratios": [h / c for c, h in zip(co_walls, hf_walls)]}


def lora_logit_delta(model: Any, prompt: list[int]) -> float:
    """Max |logit(adapter) - logit(base)| on one prompt: proves the adapter is not a no-op."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        with_lora = model(input_ids=ids).logits
        with model.disable_adapter():
            without = model(input_ids=ids).logits
    return float((with_lora - without).abs().max())


def arm_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM CPU (run under .vllm-venv): ``LLM.generate`` with a LoRARequest per LoRA prompt."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ncpu = os.cpu_count() or 1
    bind = "all" if spec["threads"] >= ncpu else f"0-{spec['threads'] - 1}"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    from vllm.lora.request import LoRARequest

    import vllm
    from vllm import LLM, SamplingParams

    model_dir = Path(spec["model_dir"])
    has_tok = (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer.model").exists()
    # max_loras=2, not 1: with a single slot vLLM-CPU 0.32.0 applies the adapter to the no-LoRA rows
    # of a mixed batch too (measured: base rows then equal all-LoRA outputs, 0/16 match transformers);
    # with two slots every row matches. One adapter is used either way.
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, enable_lora=any(spec["lora_mask"]),
              max_lora_rank=16, max_loras=2, max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_batch_tokens"], max_model_len=512, seed=0,
              skip_tokenizer_init=not has_tok, enable_prefix_caching=False)
    lora = LoRARequest(ADAPTER_NAME, 1, spec["adapter_dir"])

    def run(prompts: list[list[int]], mask: list[bool], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=has_tok)
        reqs = [lora if m else None for m in mask]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=reqs, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    wp, wm = warmup_slice(spec)
    run(wp, wm, spec["warmup_tokens"])
    outputs, walls = timed(lambda: run(spec["prompts"], spec["lora_mask"], spec["max_tokens"]),
                          spec["repeats"])
    return finish(spec, outputs, walls, versions={"vllm": vllm.__version__},
                  env={k: v for k, v in os.environ.items() if k.startswith("VLLM_")})


ARMS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "coserve": arm_coserve, "hf": arm_hf, "paired": arm_paired, "vllm": arm_vllm}


def main(argv: list[str] | None = None) -> int:
    """Entry point of one arm's subprocess: read the spec, run the arm, write the result."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arm", choices=sorted(ARMS))
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    result = ARMS[args.arm](spec)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
