"""Cluster-scale what-ifs with the simulator: 1-16 engines, 1000 tenants, 20 requests/s.

    .venv/bin/python -m coserve.bench.whatif [--engines 1,2,4,8,16] [--rate 20] [--window-s 60]
        [--policies coserve,dynamic-temporal] [--json OUT]

Every engine is Llama-3.1-8B on one A100 as `simulator.gpu_latency_model` describes (published
figures, not a measurement) with FlexLLM's SLOs for that model (TPOT 50 ms, TTFT 5 s), 4096 KV blocks of
16 tokens, up to 64 running requests, and its own fine-tuning job (1024-4096-token sequences, batch 1).
Requests come from 1000 tenants (uniformly), at ShareGPT's full lengths (`traces.sharegpt_lengths`
with scale 1, prompts up to 2048 and outputs up to 1024 tokens), Poisson at `rate` requests/s, routed
by the cluster scheduler (`coserve/cluster/engine_cluster.py`: load, adapter and prefix affinity, late
binding; until 2026-11-25 the simulator sent each to the engine with the fewest unfinished requests).
`coserve bench cluster project` is the fuller projection (many-tenant trace, the scheduler's own time).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits
from coserve.bench.run_metrics import SLO, summarize
from coserve.bench.simulator import EngineShape, gpu_latency_model, simulate_cluster
from coserve.bench.traces import make_trace, poisson_arrivals, sharegpt_lengths, synthetic_training_examples
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.inference.scheduler_config import SchedulerConfig

SHAPE = EngineShape(num_kv_blocks=4096, block_size=16, num_adapter_slots=8, vocab_size=128256,
                    num_layers=32)
SLO_8B = SLO(ttft_s=5.0, tpot_s=0.050)  # FlexLLM §8: 50 ms TPOT for the 8B model, 5 s maximum TTFT


def _job(engine: int, seed: int) -> FinetuneJobSpec:
    examples = synthetic_training_examples(64, seed=seed + engine, vocab_size=SHAPE.vocab_size,
                                           min_tokens=1024, max_tokens=4096)
    return FinetuneJobSpec(job_id=f"job-{engine}", tenant=f"ft-{engine}", adapter_id=2**41 + engine,
                           examples=examples, n_epochs=1000, batch_size=1, seed=seed,
                           num_layers=SHAPE.num_layers, output_dir=f"/sim/job-{engine}",
                           max_window_tokens=1024)


def run_whatif(engines: list[int], rate: float, window_s: float, policies: list[str],
               num_tenants: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """One simulated cluster run per (policy, engine count); rows of metrics plus the wall time."""
    setup = PolicySetup(scheduler=SchedulerConfig(max_model_len=8192, max_num_seqs=64,
                                                  max_batch_tokens=2048, block_size=16),
                        slo=SLO_8B, latency=gpu_latency_model())
    lengths = sharegpt_lengths(scale=1.0, prompt_range=(4, 2048), output_range=(2, 1024))
    tenants = [f"tenant-{i}" for i in range(num_tenants)]
    trace = make_trace(poisson_arrivals(rate, window_s, seed), seed, lengths=lengths, tenants=tenants)
    rows = []
    for policy in policies:
        for n in engines:
            t0 = time.monotonic()
            run = simulate_cluster(make_factory(policy, setup), trace, RunLimits(window_s, 30.0),
                                   gpu_latency_model(), SHAPE, n, job_specs=[_job(i, seed) for i in range(n)],
                                   policy_name=policy, rate=rate)
            row = {"engines": n, **summarize(run, SLO_8B).to_dict(),
                   "simulated_s": run.ended_s, "wall_s": time.monotonic() - t0}
            rows.append(row)
            print(f"{policy:>16} engines {n:>2}: SLO {row['slo_attainment']:.3f}  inference "
                  f"{row['inference_tokens_per_s']:8.0f} tok/s  fine-tuning {row['finetune_tokens_per_s']:8.0f} "
                  f"tok/s  TTFT p99 {row['ttft_p99_ms']:.0f} ms  TPOT p99 {row['tpot_p99_ms']:.1f} ms  "
                  f"({row['wall_s']:.1f} s wall)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="1,2,4,8,16")
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--policies", default="coserve")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = run_whatif([int(e) for e in args.engines.split(",")], args.rate, args.window_s,
                      [p.strip() for p in args.policies.split(",")], args.tenants)
    if args.json is not None:
        args.json.write_text(json.dumps({"slo": {"tpot_ms": 50.0, "ttft_ms": 5000.0}, "rows": rows},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
