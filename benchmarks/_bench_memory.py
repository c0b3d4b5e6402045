"""coserve's memory check for ``benchmarks/engine_throughput.py``: RSS over >= N engine iterations."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

Runner = Callable[[list[list[int]], list[bool], int], list[list[int]]]


def current_rss_mib() -> float:
    """Current resident set size of this process in MiB (VmRSS from /proc)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def count_engine_steps(llm: Any) -> list[int] | None:
    """Wrap ``llm.engine.step`` to count engine iterations; ``None`` if the engine has no such hook."""
    counter = [0]
    engine = getattr(llm, "engine", None)
    step = getattr(engine, "step", None)
    if step is None:
        return None

    def counted(*a: Any, **kw: Any) -> Any:
        counter[0] += 1
        return step(*a, **kw)

    try:
        engine.step = counted
    except AttributeError:
        return None
    return counter


def coserve_memory_check(run: Runner,
                         spec: dict[str, Any], steps: list[int] | None) -> dict[str, Any]:
    """Repeat small mixed generate calls for >= ``memory_iterations`` engine iterations; RSS drift.

    Each call decodes 32 tokens for 8 fresh prompts (the timed prompts' tokens reshuffled, half of
    them LoRA). Iterations are counted at ``llm.engine.step``; without that hook each call counts as
    32 (a lower bound). RSS is sampled after two warm calls (allocator caches primed) and at the end.
    """
    import random

    rng = random.Random(1234)
    base, mask, tokens = spec["prompts"][:8], spec["lora_mask"][:8], 32

    def fresh() -> list[list[int]]:
        return [rng.sample(p, len(p)) for p in base]

    def done_iters(calls: int) -> int:
        return steps[0] - steps0 if steps is not None else calls * tokens

    for _ in range(2):
        run(fresh(), mask, tokens)
    gc.collect()
    steps0 = steps[0] if steps is not None else 0
    start_rss, samples, calls = current_rss_mib(), [], 0
    t0 = time.perf_counter()
    while done_iters(calls) < spec["memory_iterations"]:
        run(fresh(), mask, tokens)
        calls += 1
        if calls % 4 == 0:
            samples.append(round(current_rss_mib(), 1))
    gc.collect()
    end_rss = current_rss_mib()
    return {"calls": calls, "iterations": done_iters(calls),
            "iterations_counted": steps is not None, "start_rss_mib": start_rss,
            "end_rss_mib": end_rss, "growth_mib": end_rss - start_rss, "rss_samples_mib": samples,
            "wall_s": time.perf_counter() - t0}


