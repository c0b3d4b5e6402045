"""What a reinforcement job's weight sync costs on `--engine vllm`, beside coserve's own engine, which has none.

vLLM keeps its own copy of every adapter it samples from, so each optimizer step's weights are exported to a
folder and loaded into vLLM before the next step's rollouts (`coserve/vllm/training_adapters.py`). The same
offline GRPO job (the addition task of `rl_smollm2.py`, a few steps) runs on each engine in turn; the script
prints each engine's seconds per step and, for vLLM, the seconds its exports took.

usage (from the repository root)::

    .venv/bin/python benchmarks/rl_vllm_sync.py --model ~/.cache/coserve/models/smollm2-135m-instruct --steps 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from coserve import LLM  # noqa: E402
from rl_smollm2 import GRADER, rows  # noqa: E402


def run(model: Path, engine: str, steps: int) -> dict[str, Any]:
    llm = LLM(str(model), engine=engine, dtype="float32", max_lora_rank=16, max_batch_tokens=512, max_num_seqs=32,
              kv_cache_memory_gb=1.0 if engine == "vllm" else None)
    train, _ = rows()
    start = time.perf_counter()
    job_id = llm.start_reinforcement(train[:8 * steps], GRADER, tempfile.mkdtemp(),
                                     {"n_epochs": 1, "batch_size": 8}, {"r": 16, "lora_alpha": 32},
                                     samples=4, max_tokens=16)
    result = llm.wait(job_id)
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"engine": engine, "state": result.state.value, "steps": steps,
                           "seconds_per_step": seconds / steps}
    adapters = getattr(llm.engine, "training_adapters", None)
    if adapters is not None:
        out.update(exports=adapters.exports, export_s=adapters.export_s,
                   export_s_per_step=adapters.export_s / max(1, adapters.exports))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--engines", default="torch,vllm")
    args = ap.parse_args()
    results = [run(args.model, engine, args.steps) for engine in args.engines.split(",")]
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
