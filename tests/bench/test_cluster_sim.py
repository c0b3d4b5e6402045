"""The cluster simulator: the scheduler's own time, the cluster's routing and placement, the many-tenant
workload, and the projection command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coserve.bench.cluster_sim import JobArrival, SchedulerCost
from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits
from coserve.bench.run_metrics import SLO, summarize
from coserve.bench.simulator import EngineShape, simulate_engines
from coserve.bench.tenant_traces import TenantMix, diurnal_arrivals, job_mix, tenant_trace, zipf_shares
from coserve.bench.traces import RequestSpec, prompt_token_ids, sharegpt_lengths, synthetic_training_examples
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel, ModelFingerprint

FP = ModelFingerprint("m", "sim", "float32")
SHAPE = EngineShape(num_kv_blocks=512, block_size=16, num_adapter_slots=4, vocab_size=1000, num_layers=4)


def _setup(latency: LatencyModel) -> PolicySetup:
    scheduler = SchedulerConfig(max_model_len=4096, max_num_seqs=8, max_batch_tokens=256, block_size=16)
    return PolicySetup(scheduler=scheduler, slo=SLO(ttft_s=1.0, tpot_s=0.05), latency=latency)


def _job(job_id: str) -> FinetuneJobSpec:
    examples = synthetic_training_examples(6, seed=2, vocab_size=1000, min_tokens=64, max_tokens=128)
    return FinetuneJobSpec(job_id=job_id, tenant="ft", adapter_id=2**41 + len(job_id), examples=examples,
                           n_epochs=1000, batch_size=1, seed=0, num_layers=4, output_dir=f"/sim/{job_id}")


def test_a_busy_scheduler_makes_the_engines_wait() -> None:
    latency = LatencyModel(FP, {"constant": 0.01})  # every step takes 10 ms
    trace = [RequestSpec(f"r{i}", 0.0, 8, 40, tenant=f"t{i % 4}") for i in range(8)]
    limits = RunLimits(0.1, drain_s=10.0)
    runs = {}
    for name, cost in (("free", SchedulerCost()), ("slow", SchedulerCost(per_exchange_s=0.01))):
        runs[name] = simulate_engines(make_factory("coserve", _setup(latency)), trace, limits, [latency] * 2,
                                      SHAPE, cost=cost)
    free, slow = runs["free"], runs["slow"]
    assert free.engine_wait_s == 0.0 and free.scheduler_busy_s == 0.0
    # 10 ms per plan handed out and 10 ms per step: with two engines the scheduler is the bottleneck, each
    # engine waits for it about as long as it computes, and the run takes about twice as long.
    assert slow.scheduler_busy_s / slow.run.ended_s == pytest.approx(1.0, abs=0.05)
    assert slow.engine_wait_s > 0.5 * free.run.ended_s
    assert slow.run.ended_s == pytest.approx(2 * free.run.ended_s, rel=0.1)
    for run in (free, slow):
        assert all(r.finished for r in run.run.requests)
        assert {it.engine_id for it in run.run.iterations} == {"engine-0", "engine-1"}


def test_requests_of_one_adapter_keep_to_the_engines_holding_it() -> None:
    latency = LatencyModel(FP, {"constant": 0.002, "decode_tokens": 0.0005, "prefill_tokens": 0.0001})
    trace = [RequestSpec(f"r{i}", 0.05 * i, 16, 8, tenant=f"t{i % 2}", adapter="lora-a" if i % 2 else None)
             for i in range(40)]
    result = simulate_engines(make_factory("coserve", _setup(latency)), trace, RunLimits(2.0, 5.0),
                              [latency] * 4, SHAPE)
    assert all(r.finished for r in result.run.requests)
    engines_of_adapter = {it.engine_id for it in result.run.iterations if it.features.distinct_adapters}
    assert 1 <= len(engines_of_adapter) < 4  # affinity: not spread over every engine


def test_jobs_arriving_mid_run_are_placed_and_train() -> None:
    latency = LatencyModel(FP, {"constant": 0.002, "decode_tokens": 0.0005, "ft_forward_tokens": 0.0001,
                                "ft_backward_token_layers": 0.00002})
    jobs = [JobArrival(0.5, _job("early")), JobArrival(1.0, _job("late"))]
    result = simulate_engines(make_factory("coserve", _setup(latency)), [], RunLimits(3.0, 0.0),
                              [latency] * 2, SHAPE, jobs=jobs)
    trained = {e: sum(it.trained_tokens for it in result.engine_iterations(e)) for e in result.engines}
    assert all(t > 0 for t in trained.values()), trained  # one job on each engine
    first_step = min(it.end_s for it in result.run.iterations if it.trained_tokens)
    assert first_step > 0.5


def test_the_many_tenant_workload() -> None:
    shares = zipf_shares(1000, 1.1)
    assert shares.sum() == pytest.approx(1.0) and shares[0] > 0.15 and shares[:100].sum() > 0.7
    arrivals = diurnal_arrivals(10.0, 600.0, seed=1, period_s=120.0)
    assert 8.0 < len(arrivals) / 600.0 < 12.5 and np.all(np.diff(arrivals) >= 0)
    mix = TenantMix(num_tenants=50, prefix_len=16, prefix_prob=1.0, adapter_fraction=0.5)
    trace = tenant_trace(arrivals[:400], seed=1, mix=mix, lengths=sharegpt_lengths())
    adapters = {s.tenant: s.adapter for s in trace}
    assert 0 < sum(a is not None for a in adapters.values()) < len(adapters)
    same = [s for s in trace if s.tenant == trace[0].tenant][:2]
    a, b = (prompt_token_ids(s, 1000) for s in same)
    assert a[:16] == b[:16] and a != b  # a shared system prompt, then the request's own tokens
    jobs = job_mix(6, 60.0, seed=1, num_layers=4, vocab_size=1000, mix=mix)
    assert len({j.spec.job_id for j in jobs}) == 6 and all(0 <= j.at_s <= 30.0 for j in jobs)


def test_the_projection_command_writes_rows_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "projection.json"
    command = [sys.executable, "-m", "coserve.cli", "bench", "cluster", "project", "--json", str(out),
               "--engines", "1,2", "--window-s", "2", "--tenants", "50", "--plots", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [(r["engines"], r["cost"]) for r in result["rows"]] == [
        (1, "decisions"), (1, "actor"), (2, "decisions"), (2, "actor")]
    for row in result["rows"]:
        assert row["decide_us_p50"] > 0 and 0 <= row["scheduler_utilization"] < 1
    assert (tmp_path / "cluster_projection_a100.png").stat().st_size > 0
    bad = subprocess.run([*command[:6], "--json", str(out), "--costs", "free"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "unknown cost models" in bad.stderr


def test_the_simulated_cluster_finishes_every_request_of_the_workload() -> None:
    latency = LatencyModel(FP, {"constant": 0.002, "decode_tokens": 0.0005, "prefill_tokens": 0.0001,
                                "ft_forward_tokens": 0.0001, "ft_backward_token_layers": 0.00002})
    mix = TenantMix(num_tenants=100, prefix_len=16)
    trace = tenant_trace(diurnal_arrivals(20.0, 4.0, seed=3, period_s=4.0), 3, mix,
                         sharegpt_lengths(scale=8.0, prompt_range=(4, 64), output_range=(2, 32)))
    jobs = job_mix(2, 4.0, seed=3, num_layers=4, vocab_size=1000, mix=mix, max_window_tokens=256)
    result = simulate_engines(make_factory("coserve", _setup(latency)), trace, RunLimits(4.0, 10.0),
                              [latency] * 3, SHAPE, jobs=jobs)
    metrics = summarize(result.run, SLO(ttft_s=1.0, tpot_s=0.05))
    assert metrics.num_finished == len(trace) and metrics.finetune_tokens_per_s > 0


def test_trace_adapters_get_distinct_stable_ids() -> None:
    from coserve.bench.replay import adapter_ref

    refs = [adapter_ref(f"lora-{k}") for k in range(5000)]
    assert len({r.adapter_id for r in refs}) == len(refs)
    assert all(0 < r.adapter_id < 2**41 for r in refs) and adapter_ref("lora-7") == refs[7]
