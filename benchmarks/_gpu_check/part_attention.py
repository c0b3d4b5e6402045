"""Which attention path ran: coserve's engine on the smallest shape, per dtype, one short greedy batch
(prompts, then decodes) under torch's profiler.

On the CPU in float32 the engine's decodes (and short chunks) go to the C kernel `paged_decode_f32`
(`coserve.forward.native`, when a C compiler is found); everywhere else (CUDA, or bf16) they take the torch
path (gathered blocks + SDPA). The kernel's calls are counted by wrapping it; the SDPA calls by the
profiler's `aten::_scaled_dot_product_*` ops, whose names say which SDPA backend torch chose (flash,
memory-efficient, cuDNN, math). Checked: on CUDA the C kernel is off and SDPA ran; on the CPU in float32
with the kernel loaded, it ran.
"""

from __future__ import annotations

from typing import Any

from torch.profiler import ProfilerActivity, profile

from _gpu_check.context import Context, free_memory
from _gpu_check.coserve_side import greedy, make_llm
from _gpu_check.models import random_prompts
from _gpu_check.record import PartRecord

MODEL = "smollm2-135m"


class _Counted:
    """The C kernel, counting its calls."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.calls = kernel, 0

    def __call__(self, *args: Any) -> None:
        self.calls += 1
        self.kernel(*args)


def _one(ctx: Context, dtype: str) -> dict[str, Any]:
    model_dir, adapter_dir = ctx.models.model(MODEL), ctx.models.adapter(MODEL)
    prompts = random_prompts(int(ctx.shapes[MODEL].fields["vocab_size"]), 4, ctx.sizes.prompt_len, seed=3)
    llm = make_llm(ctx, model_dir, dtype, len(prompts), ctx.sizes.parity_kv_blocks, 4096)
    engine = llm.engine
    kernel = getattr(engine, "_decode_kernel", None)
    if kernel is not None:
        engine._decode_kernel = counted = _Counted(kernel)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        greedy(llm, adapter_dir, prompts, [i % 2 == 1 for i in range(len(prompts))], 4)
    sdpa = {e.key: e.count for e in prof.key_averages()
            if "scaled_dot_product" in e.key and e.key != "aten::scaled_dot_product_attention"}
    del llm, engine
    free_memory()
    return {"decode_path": "C kernel paged_decode_f32" if kernel is not None else "torch (gathered blocks + SDPA)",
            "c_kernel_calls": counted.calls if kernel is not None else 0, "sdpa_ops": sdpa}


def run(ctx: Context, rec: PartRecord) -> None:
    lines = []
    for dtype in ("float32", "bfloat16"):
        res = _one(ctx, dtype)
        rec.details[dtype] = res
        ran = res["decode_path"] + (f" ({res['c_kernel_calls']} calls)" if res["c_kernel_calls"] else "")
        rec.check(f"{dtype}: decode attention", ran)
        rec.check(f"{dtype}: SDPA ops (prefill, and decodes on the torch path)", res["sdpa_ops"] or "none")
        if ctx.cuda:
            torch_path = res["c_kernel_calls"] == 0 and bool(res["sdpa_ops"])
            rec.check(f"{dtype}: CUDA takes the torch path, SDPA ran", torch_path, "true", torch_path)
        elif res["decode_path"].startswith("C kernel"):
            rec.check(f"{dtype}: the C kernel ran", res["c_kernel_calls"], "> 0", res["c_kernel_calls"] > 0)
        lines.append(f"{dtype}: {ran}; SDPA {', '.join(k.removeprefix('aten::') for k in res['sdpa_ops']) or 'none'}")
    rec.summary = "; ".join(lines)
