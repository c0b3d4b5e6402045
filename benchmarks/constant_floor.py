"""How much iteration constant any policy keeping every request's SLO must pay: a floor from the trace alone.

    .venv/bin/python benchmarks/constant_floor.py benchmarks/out/coserving_q11.json

A request that arrives at `a` with `n` output tokens and meets TTFT <= T and a mean TPOT <= S has all of
its tokens sampled in [a, a + T + (n - 1) S]: n iterations inside that window. Iterations serve many
requests at once, but two requests whose windows do not overlap cannot share one, so the heaviest set of
pairwise disjoint windows (weights n; weighted interval scheduling) is a lower bound on the iterations
of any such policy. Only windows that end inside the benchmark's window count (a request that straddles
its end may be served after it). Times the fitted per-iteration constant, that is a floor on the time
every policy spends on constants; the script prints it next to what fine-tuning alone spends on its own
iterations' constants (its iterations last the stall cap), the difference being what a bound could
charge on top of `headroom` (`coserve/bench/headroom.py`). `coserve bench co-serving` now reports that
bound itself (`coserve/bench/slo_bound.py`, from each request's produced tokens); this script reads the
trace of an older JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from coserve.bench.slo_bound import heaviest_disjoint
from coserve.bench.traces import make_trace, poisson_arrivals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="a `coserve bench co-serving` JSON")
    result = json.loads(parser.parse_args().json.read_text())
    tpot, ttft = result["slo"]["tpot_ms"] / 1000.0, result["slo"]["ttft_ms"] / 1000.0
    settings = result["settings"]
    window, seed = settings["window_s"], settings["seed"]
    constant = result["latency_model"]["coefficients"]["constant"]
    finetune_alone_share = constant / (settings["max_stall_ms"] / 1000.0)
    print(f"TPOT SLO {tpot * 1000:.1f} ms, TTFT SLO {ttft * 1000:.0f} ms, constant {constant * 1000:.1f} ms; "
          f"fine-tuning alone spends ~{finetune_alone_share:.1%} of its time on constants")
    for rate in settings["rates"]:
        trace = make_trace(poisson_arrivals(rate, window, seed), seed)
        windows = [(r.arrival_s, r.arrival_s + ttft + (r.output_len - 1) * tpot, r.output_len) for r in trace]
        inside = [w for w in windows if w[1] <= window]
        floor = heaviest_disjoint(inside)
        print(f"rate {rate:g}: {len(trace)} requests, {len(inside)} with windows inside the run; at least "
              f"{floor} iterations = {floor * constant / window:.1%} of the window on constants "
              f"(one iteration per TPOT SLO all along would be {window / tpot:.0f})")


if __name__ == "__main__":
    main()
