"""Two real engines (tiny model, each on its own thread) under one cluster scheduler, and the cluster
simulator against that run.

* The in-process driver serves every request of a short trace on both engines (the router uses both),
  places one fine-tuning job on each, records one time per output token and the scheduler's CPU per
  iteration.
* The cluster simulator, given per-engine latency models fitted on that run's own iterations (and each
  engine's loop overhead and noise), reproduces the run's inference throughput within 15%, and every
  request finishes in it too; it runs the same cluster code (routing, placement).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coserve.bench.cluster_sim import JobArrival
from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits
from coserve.bench.run_metrics import SLO, relative_error, summarize
from coserve.bench.simulator import (
    EngineShape,
    SimSettings,
    measured_overhead_s,
    simulate_engines,
    truth_model_from_run,
)
from coserve.bench.traces import RequestSpec, synthetic_training_examples
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.training_settings import LoRASettings
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel, ModelFingerprint

NUM_BLOCKS, BLOCK = 256, 16
FP = ModelFingerprint("tiny", "here", "float32")
LIMITS = RunLimits(1.5, drain_s=5.0)


def _job(vocab: int, job_id: str, out: Path, adapter_id: int) -> FinetuneJobSpec:
    examples = synthetic_training_examples(8, seed=1, vocab_size=vocab, min_tokens=48, max_tokens=96)
    return FinetuneJobSpec(job_id=job_id, tenant=f"ft-{job_id}", adapter_id=adapter_id, examples=examples,
                           n_epochs=1000, batch_size=1, seed=0, num_layers=2, output_dir=str(out / job_id),
                           lora=LoRASettings(r=4, lora_alpha=8), max_window_tokens=64)


def _trace(n: int, spacing: float) -> list[RequestSpec]:
    return [RequestSpec(f"q{i}", spacing * i, 8 + 5 * (i % 5), 6 + 3 * (i % 4), tenant=f"t{i % 3}")
            for i in range(n)]


@pytest.fixture(scope="module")
def cluster_bench(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from coserve.bench.cluster_replay import replay_engines
    from coserve.contract.engine_config import EngineConfig

    config = EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                          max_loras=2, max_lora_rank=8)
    out = tmp_path_factory.mktemp("jobs")
    # A fixed latency model and SLO for the policies (what the planner believes; the test compares the
    # simulator with the run, not the planner with the machine).
    latency = LatencyModel(FP, {"constant": 2e-3, "decode_tokens": 2e-4, "prefill_tokens": 5e-5,
                                "ft_forward_tokens": 5e-5, "ft_backward_token_layers": 1e-5})
    scheduler = SchedulerConfig(max_model_len=512, max_num_seqs=8, max_batch_tokens=128, block_size=BLOCK)
    setup = PolicySetup(scheduler=scheduler, slo=SLO(ttft_s=1.0, tpot_s=0.02), latency=latency)
    trace = _trace(16, 0.08)
    vocab = 256
    jobs = [_job(vocab, f"run{i}", out, 2**41 + i) for i in range(2)]
    run = replay_engines([config, config], make_factory("coserve", setup), trace, LIMITS, jobs=jobs,
                         num_layers=2, policy_name="coserve", rate=12.0)
    return {"setup": setup, "trace": trace, "run": run, "out": out, "vocab": vocab}


def test_two_engines_serve_the_trace_under_one_scheduler(cluster_bench: dict) -> None:
    result = cluster_bench["run"]
    run = result.run
    assert result.engines == ("engine-0", "engine-1")
    for spec, record in zip(cluster_bench["trace"], run.requests):
        assert record.request_id == spec.request_id and record.finished
        assert len(record.token_times) == spec.output_len and record.token_times[0] >= spec.arrival_s
    per_engine = {e: result.engine_iterations(e) for e in result.engines}
    assert all(its and any(it.inference_tokens for it in its) for its in per_engine.values())
    assert all(any(it.trained_tokens for it in its) for its in per_engine.values()), "a job did not train"
    assert all(d > 0 for d in result.decide_s()) and len(result.route_s) == len(run.requests)


def test_the_cluster_simulator_reproduces_the_two_engine_run(cluster_bench: dict) -> None:
    result = cluster_bench["run"]
    models, sims = [], []
    for i, engine in enumerate(result.engines):
        iterations = result.engine_iterations(engine)
        single = type(result.run)(result.run.policy, result.run.rate, result.run.window_s, [], iterations,
                                  result.run.num_layers)
        model, sigma = truth_model_from_run(single, FP)
        models.append(model)
        sims.append(SimSettings(overhead_s=measured_overhead_s(single), noise_sigma=sigma, seed=i))
    shape = EngineShape(NUM_BLOCKS, BLOCK, 2, cluster_bench["vocab"], 2)
    jobs = [JobArrival(0.0, _job(cluster_bench["vocab"], f"sim{i}", cluster_bench["out"], 2**42 + i))
            for i in range(2)]
    sim = simulate_engines(make_factory("coserve", cluster_bench["setup"]), cluster_bench["trace"], LIMITS,
                           models, shape, jobs=jobs, sims=sims, policy_name="coserve", rate=12.0)
    slo = cluster_bench["setup"].slo
    real, simulated = summarize(result.run, slo), summarize(sim.run, slo)
    assert simulated.num_finished == real.num_finished == len(cluster_bench["trace"])
    error = relative_error(simulated.inference_tokens_per_s, real.inference_tokens_per_s)
    assert error <= 0.15, f"simulated {simulated.inference_tokens_per_s} vs measured {real.inference_tokens_per_s}"
    assert {it.engine_id for it in sim.run.iterations} == {"engine-0", "engine-1"}


def test_the_validation_rows_feed_the_projection(llama_dir: Path, tmp_path: Path) -> None:
    """`cluster validate`'s measured pair (1 and 2 engines, each simulated; the 2-engine run predicted
    from the 1-engine one) on the tiny model, its plot, and `cluster project --from` reading the result."""
    import argparse
    import dataclasses

    from coserve.bench.cluster_plots import validation_plot
    from coserve.bench.cluster_projection import measured_engine, project_point
    from coserve.bench.cluster_validate import _measure_pair
    from coserve.contract.engine_config import EngineConfig

    config = EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                          max_loras=2, max_lora_rank=8)
    latency = LatencyModel(FP, {"constant": 2e-3, "decode_tokens": 2e-4, "prefill_tokens": 5e-5,
                                "ft_forward_tokens": 5e-5, "ft_backward_token_layers": 1e-5})
    setup = PolicySetup(scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=8, max_batch_tokens=128,
                                                  block_size=BLOCK),
                        slo=SLO(ttft_s=1.0, tpot_s=0.02), latency=latency)
    shape = EngineShape(NUM_BLOCKS, BLOCK, 2, 256, 2)
    rows = _measure_pair(argparse.Namespace(seed=3), config, setup, _job(256, "v", tmp_path, 2**41), 6.0, 2.0,
                         shape, FP)
    assert [r["engines"] for r in rows] == [1, 2] and "predicted_from_1_engine" in rows[1]
    for row in rows:
        assert row["measured"]["num_finished"] > 0 and len(row["engine_models"]) == row["engines"]
        assert set(row["simulated"]) >= {"inference_tokens_per_s", "finetune_tokens_per_s", "slo_attainment"}
    result = {"machine": "here", "runs": rows, "shape": dataclasses.asdict(shape),
              "policy_latency_model": {"coefficients": latency.coefficients},
              "setup": {"scheduler": dataclasses.asdict(setup.scheduler), "slo": dataclasses.asdict(setup.slo),
                        "safety_margin": 0.1, "max_stall_ms": None, "fingerprint": dataclasses.asdict(FP)}}
    assert validation_plot(result, tmp_path).stat().st_size > 0
    kind = measured_engine(result)
    assert kind.model.coefficients == pytest.approx(rows[0]["engine_models"][0])
    point = project_point(kind, 2, 3.0, 6.0, "decisions", seed=0, num_tenants=20)
    assert point["engines"] == 2 and point["num_requests"] > 0 and point["decide_us_p50"] > 0
