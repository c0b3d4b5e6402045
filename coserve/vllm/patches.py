"""The three places where coserve changes vLLM 0.32.0's behaviour in this process, and why.

Each is a documented internal of that exact version (`vllm_backend.check_vllm` refuses any other):
the environment vLLM reads at import, the CPU linear layers' weights kept for the trainer's views, and
seeded CPU generators rewound when vLLM discards a sample, as it does on CUDA.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch


def set_environment(device: str) -> None:
    """vLLM reads these at import and engine start: the engine core in this process (the trainer shares
    its tensors), no hub access, OpenMP threads not pinned to a core subset on CPU.

    On CPU, torch.compile's kernel cache (vLLM's sampler compiles) is kept per kernel set: its key leaves
    out `ATEN_CPU_CAPABILITY`, so a kernel generated for AVX-512 and found again under `default` does not
    compile (`at::vec has not been declared`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        _inductor_cache_per_kernel_set()


def _inductor_cache_per_kernel_set() -> None:
    """torch's default kernel cache folder, suffixed with the kernel set (a folder the operator chose is
    kept). torch writes its default into the environment the first time it asks, so compare with it."""
    default = importlib.import_module("torch._inductor.runtime.cache_dir_utils").default_cache_dir()
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{torch.backends.cpu.get_cpu_capability().lower()}"


def keep_cpu_weights() -> None:
    """vLLM's CPU linear layers hand their weight to oneDNN and free it; keep it (the trainer's views)."""
    utils: Any = importlib.import_module("vllm.model_executor.layers.utils")  # vLLM ships no types
    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_coserve_keeps_weights", False):
        return

    def keep(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, False)

    keep._coserve_keeps_weights = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = keep
    # Modules that imported the function by name before this patch.
    for name in ("vllm.model_executor.layers.linear", "vllm.model_executor.layers.vocab_parallel_embedding"):
        module: Any = importlib.import_module(name)
        if getattr(module, "dispatch_cpu_unquantized_gemm", None) is dispatch:
            module.dispatch_cpu_unquantized_gemm = keep


def rewind_cpu_generators(runner: Any) -> None:
    """Undo a discarded sample of a seeded request on CPU, as vLLM does on CUDA.

    A chunk that ends inside the prompt still samples, and vLLM's runner discards the token and rewinds
    the request's generator by its offset (`_bookkeeping_sync`), which only CUDA generators have: on
    CPU a seeded request whose prompt spans several chunks stopped the engine ("CPU Generator does not
    use offset"). Here the seeded generators' states are kept before each sample (`_sample`), and the
    discarded ones get theirs back, out of the runner's sight, so the same seed gives the same tokens
    however the prompt was chunked.
    """
    states: dict[int, torch.Tensor] = {}
    sample, bookkeeping = runner._sample, runner._bookkeeping_sync

    def keep_states_then_sample(*args: Any, **kwargs: Any) -> Any:
        states.clear()
        states.update({i: g.get_state() for i, g in runner.input_batch.generators.items()})
        return sample(*args, **kwargs)

    def bookkeeping_with_states_restored(*args: Any, **kwargs: Any) -> Any:
        generators = runner.input_batch.generators
        discarded = runner.discard_request_mask.np[:runner.input_batch.num_reqs].nonzero()[0]
        held = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            for i, generator in held.items():
                if i in states:
                    generator.set_state(states[i])
                generators[i] = generator
            states.clear()  # this step's, never restored in another

    runner._sample = keep_states_then_sample
    runner._bookkeeping_sync = bookkeeping_with_states_restored
