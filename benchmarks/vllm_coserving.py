"""Co-serving on vLLM vs coserve's engine, with the temporal-sharing baseline, in one run (issue 18).

`coserve bench co-serving` once per engine (`--engine native`, then `--engine vllm`), same model, same
seed, so the same arrival trace at each rate and the same fine-tuning job. The SLO is calibrated on
coserve's engine (its measured decode step, as the benchmark does) and handed to the vLLM run, so both
engines are held to one SLO. Per engine and policy: SLO attainment, inference and fine-tuning tokens/s,
and fine-tuning alone.

    .venv/bin/python benchmarks/vllm_coserving.py --rates 2 --policies coserve,temporal-n128 --window-s 16 \
        --json benchmarks/out/vllm_coserving.json [any other `coserve bench co-serving` option]
"""

from __future__ import annotations

import argparse
import json
import sys

from coserve.bench.coserving import add_arguments, run_benchmark
from coserve.contract.engine import EngineKind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    args = ap.parse_args()
    results = {}
    for engine in (EngineKind.TORCH, EngineKind.VLLM):
        run = argparse.Namespace(**{**vars(args), "engine": engine})
        print(f"--- engine {engine.value}", flush=True)
        result = run_benchmark(run)
        result.pop("_bursty")
        results[engine.value] = result
        if args.tpot_slo_ms is None:  # the vLLM run keeps coserve's engine's calibrated SLO
            args.tpot_slo_ms, args.ttft_slo_ms = result["slo"]["tpot_ms"], result["slo"]["ttft_ms"]
    print(f"{'engine':>7} {'policy':>16} {'rate':>5} {'SLO att':>8} {'infer tok/s':>12} {'FT tok/s':>9}")
    for engine, result in results.items():
        print(f"{engine:>7} {'fine-tuning only':>16} {'-':>5} {'-':>8} {'-':>12} "
              f"{result['finetune_only_tokens_per_s']:9.1f}")
        for r in result["runs"]:
            att = "-" if r["slo_attainment"] is None else f"{r['slo_attainment']:.2f}"
            print(f"{engine:>7} {r['policy']:>16} {r['rate']:>5} {att:>8} {r['inference_tokens_per_s']:12.1f} "
                  f"{r['finetune_tokens_per_s']:9.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, allow_nan=False, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
