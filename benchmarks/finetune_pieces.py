"""What a fine-tuning piece adds to a decode iteration: the co-serving benchmark's engine and job.

Eight base-model requests decode (256-token prompts) on the `small` preset; the co-serving benchmark's
fine-tuning job (`coserving.bench_job_spec`) runs next to them. Each round is two iterations side by
side: the decode batch alone, then the decode batch with one fine-tuning piece (a forward window of
w tokens, or a backward tasklet of n token-layers; the job takes the kind its sequence is at). The
reported cost of a piece is the median over rounds of (with piece - alone), so both halves of a pair
are taken milliseconds apart on this noisy machine. Iterations with an optimizer step are left out.

    .venv/bin/python benchmarks/finetune_pieces.py [--windows 4,8,16,32,64] [--tasklets 64,512] \
        [--rounds 30] [--threads 2]

A piece's fixed cost (its cost at a handful of tokens) is what co-serving pays more often than
temporal sharing: the hybrid policy runs fine-tuning in short bursts next to decodes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from coserve.bench.calibration import add_requests, fcfs_policy
from coserve.bench.coserving import NUM_KV_BLOCKS, bench_job_spec
from coserve.bench.replay import AdapterSlotTracker
from coserve.bench.trainer import ensure_model
from coserve.cluster.engine_core import EngineCore
from coserve.contract.engine_config import EngineConfig
from coserve.finetune.job import CoservedJob
from coserve.finetune.pieces import JobPieces
from coserve.torch_engine.engine import TorchEngine

DECODE_BATCH, PROMPT_LEN = 8, 256


def _step(engine: TorchEngine, core: EngineCore, pieces: JobPieces, tracker: AdapterSlotTracker,
          budget: tuple[int, int] | None = None) -> tuple[float, tuple[str, int] | None]:
    """One iteration (with the job's piece when a budget is given); returns its time and the piece, as
    (kind, units), when the iteration decoded the whole batch next to exactly one kind of piece."""
    pieces.budget = budget
    step = core.step(engine)
    features = tracker.features(step.plan)
    work = step.plan.training
    piece = None
    if len(step.plan.chunks) == DECODE_BATCH and not work.optimizer_steps:
        if work.forward_windows and not work.backward_tasklets:
            piece = ("forward window, tokens", int(features.ft_forward_tokens))
        elif work.backward_tasklets and not work.forward_windows and len(work.backward_tasklets) == 1:
            piece = ("backward tasklet, token-layers", int(features.ft_backward_token_layers))
    return step.result.timings.total_s, piece


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", default="4,8,16,32,64")
    ap.add_argument("--tasklets", default="64,512")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir, _ = ensure_model(None)
    engine = TorchEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS,
                                 block_size=16, max_loras=2, max_lora_rank=16, seed=0))
    spec = bench_job_spec(AutoTokenizer.from_pretrained(str(model_dir)), engine.model_config.num_layers,
                          engine.layout.max_model_len, Path(tempfile.mkdtemp()), seed=0)
    policy = fcfs_policy(engine.layout, 2048, DECODE_BATCH)
    pieces, tracker = JobPieces(CoservedJob(spec, policy.kv, policy.adapters)), AdapterSlotTracker()
    core = EngineCore(policy, pieces)
    add_requests(policy, engine.layout, "decode", DECODE_BATCH, PROMPT_LEN, 1_000_000)
    for _ in range(20):  # prefills, and a warm decode path
        _step(engine, core, pieces, tracker)
    layers = engine.model_config.num_layers
    budgets = ([(int(w), 64 * layers) for w in args.windows.split(",")]
               + [(64, int(n)) for n in args.tasklets.split(",")])
    costs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for budget in budgets:
            alone, _ = _step(engine, core, pieces, tracker)
            mixed, piece = _step(engine, core, pieces, tracker, budget)
            if piece is not None:
                costs.setdefault(piece, []).append((alone, mixed - alone))
    print(f"{DECODE_BATCH} decodes at ~{PROMPT_LEN} tokens, small preset, float32, {args.threads} threads")
    for (kind, units), pairs in sorted(costs.items()):
        alone = statistics.median(a for a, _ in pairs)
        extra = statistics.median(e for _, e in pairs)
        print(f"{kind:>30} {units:5d}: n={len(pairs):3d}  decode alone {1000 * alone:5.1f} ms  "
              f"+{1000 * extra:5.1f} ms ({1000 * extra / units:.3f} ms per unit)")


if __name__ == "__main__":
    main()
