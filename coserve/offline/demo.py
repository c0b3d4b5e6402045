"""`coserve demo`: an offline generation run on a model folder, printed to the terminal.

It loads the model with coserve's own engine (no server; `make run` serves over HTTP), generates for
a few chat prompts (some through a freshly made LoRA adapter, to show base and adapter rows sharing one
batch) and prints the texts and the measured throughput.
"""

from __future__ import annotations

import time
from pathlib import Path

DEMO_CHATS = [
    [{"role": "user", "content": "What is a paged KV cache?"}],
    [{"role": "system", "content": "You answer in one line."},
     {"role": "user", "content": "Name a prime number."}],
    [{"role": "user", "content": "Write a short poem about batching."}],
    [{"role": "user", "content": "Why share one GPU between serving and fine-tuning?"}],
]


def make_demo_adapter(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A rank-8 PEFT adapter on all projections with random B, so it visibly changes outputs."""
    from coserve.model.tiny_model import create_random_adapter

    return create_random_adapter(model_dir, out, seed=seed, b_std=0.05, r=8, lora_alpha=16,
                                 target_modules="all-linear")


def run_demo(model_dir: str, max_tokens: int = 32, dtype: str = "float32", device: str = "cpu") -> None:
    """Generate for the demo chats, half of them through a LoRA adapter, and print the results."""
    from coserve.contract.sampling import SamplingParams
    from coserve.offline.llm import LLM
    from coserve.offline.lora_request import LoRARequest

    model = Path(model_dir)
    adapter = make_demo_adapter(model, model.parent / f"{model.name}-demo-lora")
    llm = LLM(model=str(model), dtype=dtype, device=device)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=max_tokens)
    loras = [None, LoRARequest("demo-lora", 1, str(adapter))] * (len(DEMO_CHATS) // 2)
    start = time.perf_counter()
    outputs = llm.chat(DEMO_CHATS, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    for chat, lora, out in zip(DEMO_CHATS, loras, outputs):
        completion = out.outputs[0]
        who = f"lora:{lora.lora_name}" if lora else "base"
        print(f"[{who}] {chat[-1]['content']}")
        print(f"  -> {completion.text!r} ({len(completion.token_ids)} tokens, "
              f"finish_reason={completion.finish_reason})")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{generated} tokens in {elapsed:.2f}s ({generated / elapsed:.0f} tokens/s) on {device}; "
          f"the model is random, so the text is noise: the point is the machinery.")
