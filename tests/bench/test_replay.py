"""Replay on a real engine (tiny model) with a fine-tuning job, and the simulator against it.

* A replay serves every request of a short trace with the job training in the same iterations, records
  one time per output token and only completed optimizer steps, and leaves the engine clean.
* The simulator, given a latency model fitted on that replay's own iterations (scaled to its total,
  with its error spread as noise) and the loop overhead measured there, reproduces the replay's
  inference and fine-tuning throughput and its mean TPOT: within 50% here, a bound that holds on a
  loaded CI machine (whose load moves the measured run's timings, not the simulator's). The accuracy
  figure itself (within ~15% on a quiet machine) is the co-serving benchmark's simulator check
  (`coserve/bench/sim_check.py`, benchmarks/RESULTS.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coserve.bench.calibration import SweepSettings, fit_latency_model, profile_engine
from coserve.bench.policy_set import PolicySetup, make_factory
from coserve.bench.replay import RunLimits, RunRecord, replay
from coserve.bench.run_metrics import SLO, relative_error, summarize
from coserve.bench.simulator import EngineShape, SimSettings, measured_overhead_s, simulate, truth_model_from_run
from coserve.bench.traces import RequestSpec, synthetic_training_examples
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.training_settings import LoRASettings
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import ModelFingerprint

NUM_BLOCKS, BLOCK = 256, 16
TINY_SWEEP = SweepSettings(decode_batches=(1, 4, 8), prompt_lens=(32,), decode_steps=3,
                           forward_windows=(16, 64), backward_budgets=(64, 256), mixed_decode_batch=4)


def _job_spec(vocab: int, job_id: str, out: Path) -> FinetuneJobSpec:
    examples = synthetic_training_examples(8, seed=1, vocab_size=vocab, min_tokens=48, max_tokens=96)
    return FinetuneJobSpec(job_id=job_id, tenant="ft", adapter_id=2**41, examples=examples, n_epochs=1000,
                           batch_size=1, seed=0, num_layers=2, output_dir=str(out / job_id),
                           lora=LoRASettings(r=4, lora_alpha=8), max_window_tokens=64)


def _trace(n: int, spacing: float) -> list[RequestSpec]:
    return [RequestSpec(f"q{i}", spacing * i, 8 + 5 * (i % 5), 6 + 3 * (i % 4)) for i in range(n)]


@pytest.fixture(scope="module")
def bench(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from coserve.contract.engine_config import EngineConfig
    from coserve.torch_engine.engine import TorchEngine

    engine = TorchEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=NUM_BLOCKS,
                                 block_size=BLOCK, max_loras=2, max_lora_rank=8))
    out = tmp_path_factory.mktemp("jobs")
    vocab = engine.layout.vocab_size
    samples = profile_engine(engine, _job_spec(vocab, "cal", out), TINY_SWEEP)
    latency = fit_latency_model(samples, ModelFingerprint("tiny", "here", "float32")).model
    # A fixed SLO: the tiny model's calibrated one is a few ms and swings with the machine's load.
    slo = SLO(ttft_s=1.0, tpot_s=0.02)
    scheduler = SchedulerConfig(max_model_len=engine.layout.max_model_len, max_num_seqs=8,
                                max_batch_tokens=128, block_size=BLOCK)
    # coserve as the benchmark runs it: fine-tuning bursts of up to 3 TPOT SLOs.
    setup = PolicySetup(scheduler=scheduler, slo=slo, latency=latency, max_stall_ms=60.0)
    trace = _trace(12, 0.1)
    run = replay(engine, make_factory("coserve", setup), trace, RunLimits(1.5, drain_s=5.0),
                 job_spec=_job_spec(vocab, "run", out), policy_name="coserve", rate=8.0)
    return {"engine": engine, "setup": setup, "trace": trace, "run": run, "out": out, "vocab": vocab}


def test_replay_serves_every_request_with_the_job_in_the_same_iterations(bench: dict) -> None:
    run: RunRecord = bench["run"]
    for spec, record in zip(bench["trace"], run.requests):
        assert record.request_id == spec.request_id and record.finished
        assert len(record.token_times) == spec.output_len
        assert record.token_times[0] >= spec.arrival_s
        assert record.token_times == sorted(record.token_times)
    mixed = [it for it in run.iterations if it.inference_tokens and it.features.ft_forward_tokens
             + it.features.ft_backward_token_layers]
    assert mixed, "no iteration carried inference and fine-tuning work together"
    trained = [it.trained_tokens for it in run.iterations if it.trained_tokens]
    assert trained, "no optimizer step completed"
    # Batch size 1: each completed step reports exactly one example's trained tokens.
    per_example = {sum(e.trained[1:]) for e in _job_spec(bench["vocab"], "x", bench["out"]).examples}
    assert set(trained) <= per_example
    starts = [it.start_s for it in run.iterations]
    assert starts == sorted(starts) and all(it.end_s >= it.start_s for it in run.iterations)
    assert bench["engine"].num_sequences == 0  # finish_run dropped every sequence from the engine


def test_simulator_reproduces_the_measured_run(bench: dict) -> None:
    run: RunRecord = bench["run"]
    model, sigma = truth_model_from_run(run, ModelFingerprint("tiny", "here", "float32"))
    overhead = measured_overhead_s(run)
    engine = bench["engine"]
    shape = EngineShape(NUM_BLOCKS, BLOCK, engine.layout.num_adapter_slots, bench["vocab"], 2)
    sim = simulate(make_factory("coserve", bench["setup"]), bench["trace"], RunLimits(1.5, drain_s=5.0),
                   model, shape, job_spec=_job_spec(bench["vocab"], "sim", bench["out"]),
                   sim=SimSettings(overhead_s=overhead, noise_sigma=sigma), policy_name="coserve", rate=8.0)
    slo = bench["setup"].slo
    real, simulated = summarize(run, slo), summarize(sim, slo)
    for key in ("inference_tokens_per_s", "finetune_tokens_per_s", "tpot_mean_ms"):
        error = relative_error(getattr(simulated, key), getattr(real, key))
        assert error <= 0.5, f"{key}: simulated {getattr(simulated, key)} vs measured {getattr(real, key)}"
