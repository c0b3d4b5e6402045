"""Planning overhead of the hybrid token policy: one `plan()` call at scale (issue 4, item 6).

Scenario: 100 tenants, 256 running requests decoding (contexts of a few hundred tokens, 8 adapters),
a waiting request per tenant, and 8 fine-tuning jobs of 8 tenants (forward windows and backward
tasklets both occur as the jobs progress). Each measured `plan()` is followed by an untimed `update()`
with a fake engine's result, so every call plans a real next iteration.

    .venv/bin/python benchmarks/planning_overhead.py [--iterations N] [--jobs 8] [--json OUT]

Target: p50 <= 200 us on the development machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

from coserve.bench.replay import job_host
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.plan import IterationPlan, IterationResult, SampledToken, ScheduledChunk
from coserve.contract.sampling import AdapterRef, SamplingParams
from coserve.contract.training_plan import SavedAdapter, StepReport, TrainingExample, TrainingReport
from coserve.finetune.job import CoservedJob
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.request import Request
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.hybrid import HybridShare
from coserve.planner.latency import LatencyModel, ModelFingerprint, machine_id
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import CoServingConfig

NUM_TENANTS, NUM_RUNNING, NUM_LAYERS = 100, 256, 32
# A plausible fitted model (seconds per unit) of an 8B model on one GPU.
COEFFICIENTS = {"constant": 4e-3, "decode_tokens": 3e-5, "prefill_tokens": 6e-5, "decode_context": 2e-8,
                "ft_forward_tokens": 8e-5, "ft_backward_token_layers": 5e-6, "distinct_adapters": 2e-4}


def build(num_jobs: int) -> CoServingPolicy:
    """The policy with 256 running requests (after their prefill) and `num_jobs` jobs."""
    sched = SchedulerConfig(max_model_len=4096, max_num_seqs=NUM_RUNNING, max_batch_tokens=2048,
                            block_size=16)
    config = CoServingConfig(scheduler=sched, tpot_slo_ms=50.0, ttft_slo_ms=60_000.0,
                             tenant_weights={f"t{i}": 1.0 + i % 3 for i in range(NUM_TENANTS)})
    kv = KVBlockManager(num_blocks=16384, block_size=16)
    latency = LatencyModel(ModelFingerprint("bench", machine_id(), "bf16"), COEFFICIENTS)
    policy = CoServingPolicy(config, kv, AdapterSlots(16), latency, share=HybridShare(), clock=lambda: 0.0)
    for i in range(NUM_RUNNING + NUM_TENANTS):
        adapter = AdapterRef(i % 8, f"lora{i % 8}", f"/lora/{i % 8}") if i % 2 else None
        prompt = [(i * 7919 + j) % 32000 for j in range(64 + (i * 37) % 400)]
        policy.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=1_000_000, ignore_eos=True),
                                   adapter=adapter, tenant=f"t{i % NUM_TENANTS}", arrival_time=0.0))
    while policy.num_running < NUM_RUNNING:  # admit and prefill everyone before measuring
        plan = policy.plan()
        policy.update(plan, result_of(plan))
    for k in range(num_jobs):
        examples = [TrainingExample(list(range(1, n + 1)), [False] + [True] * (n - 1))
                    for n in (300, 500, 700, 900)]
        spec = FinetuneJobSpec(job_id=f"job{k}", tenant=f"t{k * 11}", adapter_id=100 + k,
                               examples=examples, n_epochs=1000, batch_size=2, seed=k,
                               num_layers=NUM_LAYERS, output_dir=f"/tmp/job{k}")
        job_host(policy).add(CoservedJob(spec, kv, policy.adapters))
    return policy


def result_of(plan: IterationPlan) -> IterationResult:
    """A fake engine: one token per sampled chunk, every optimizer step and save reported done."""
    training = plan.training
    report = TrainingReport(
        steps=[StepReport(s.job_id, s.step, 1.0, 1.0, 1e-4, s.num_sequences, s.num_tokens)
               for s in training.optimizer_steps],
        saved=[SavedAdapter(s.job_id, s.path, s.step) for s in training.saves])
    return IterationResult(plan.step_id, [SampledToken(c.request_id, 7) for c in plan.chunks if c.sample],
                           training=report)


def measure(policy: CoServingPolicy, iterations: int) -> list[float]:
    """Seconds of each `plan()` call (the update after it is not timed)."""
    times = []
    gc.disable()  # a collection pause is not planning work; it is measured separately by Python
    try:
        for _ in range(iterations):
            start = time.perf_counter()
            plan = policy.plan()
            times.append(time.perf_counter() - start)
            policy.update(plan, result_of(plan))
    finally:
        gc.enable()
    return times


def contract_floor(iterations: int) -> float:
    """Median seconds to only build 256 decode chunks (sharing their tables, as the planner's kept
    snapshots do): what any planner that emits the `IterationPlan` contract pays for this batch,
    before deciding anything."""
    tables = [tuple(range(n % 40 + 4)) for n in range(NUM_RUNNING)]
    ids = [f"r{i}" for i in range(NUM_RUNNING)]
    new_tuple = tuple.__new__  # how the planner builds chunks (see ScheduledChunk)
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        chunks = [new_tuple(ScheduledChunk, (rid, 300, 1, table, True))
                  for rid, table in zip(ids, tables)]
        times.append(time.perf_counter() - start)
    del chunks
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args()
    policy = build(args.jobs)
    measure(policy, 20)  # warm-up
    times = measure(policy, args.iterations)
    us = sorted(t * 1e6 for t in times)
    out = {"p50_us": statistics.median(us), "p90_us": us[int(0.9 * len(us))], "p99_us": us[int(0.99 * len(us))],
           "contract_floor_us": contract_floor(args.iterations) * 1e6,
           "iterations": len(us), "tenants": NUM_TENANTS, "running": policy.num_running,
           "waiting": policy.num_waiting, "jobs": args.jobs, "machine": machine_id(),
           "python": platform.python_version()}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
