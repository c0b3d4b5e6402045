"""`--gpu-memory-utilization` on `--engine vllm`: coserve's meaning is vLLM's (the fraction of the GPU's
total memory the engine may use), with the trainer inside it. vLLM sizes its KV cache from the fraction it
is given, less what it measured for its weights, its LoRA bank and a profiled forward; the trainer's
memory (a job's adapter with its AdamW state, a training sequence's kept inputs, a window's working set:
`coserve.model.memory.trainer_reserve_bytes`) lives in the same process outside vLLM's count, so vLLM is
given the operator's fraction less the trainer's share of the device.
"""

from __future__ import annotations

from coserve.contract.kv_capacity import KvCacheTooSmall

GIB = 2**30


def vllm_utilization(utilization: float, trainer_bytes: int, total_bytes: int) -> float:
    """The fraction to hand vLLM so that vLLM and the trainer together stay within `utilization`.

    Raises:
        KvCacheTooSmall: the trainer's reserve alone takes the whole fraction.
    """
    share = utilization - trainer_bytes / total_bytes
    if share <= 0:
        raise KvCacheTooSmall(
            f"--gpu-memory-utilization {utilization:g} gives the engine {utilization * total_bytes / GIB:.2f} GiB, "
            f"and the fine-tuning reserve alone takes {trainer_bytes / GIB:.2f} GiB: raise "
            f"--gpu-memory-utilization, or lower --max-model-len")
    return share
