"""A dedicated fine-tuning run on real Ray Train: 2 CPU workers (gloo), on the package's one cluster
(`conftest.ray_cluster`). The run trains what the co-served trainer trains (the single-process `LLM.fine_tune`
is the reference, fp32, same seed), a supervised job and a DPO job, checkpoints through Ray Train into the
job's folder, and comes back from a killed worker through Ray Train's FailureConfig (the DPO run)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from coserve import LLM
from coserve.contract.dedicated_run import Command, RunSpec, RunUpdate
from coserve.contract.job_spec import JobEvent, JobEventKind
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.trainer_state import read_trainer_state
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings
from coserve.dedicated.run import launch
from coserve.jobs.prepared_job import prepare_job
from coserve.offline.finetune import FineTuneResult

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXAMPLES = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(14)]
VALIDATION = [{"messages": [{"role": "user", "content": "What is 20 plus 20?"},
                            {"role": "assistant", "content": "20 plus 20 is 40."}]}]
# fp32 on both sides; the 2 workers sum their halves of each batch's gradient in another order than one
# process accumulates it (and use dense K/V where the engine pages them), and the curve compounds that
# rounding over the steps. Measured (12 steps, 2026-11-25): loss <= 1.1e-7 relative, adapter weights
# (|w| <= 0.09) <= 3e-7 absolute, far below what a wrong batch, a missed gradient shard or a mean instead of
# a sum over the ranks would change (whole percents). The bounds (tests/numerics.py):
LOSS_RTOL = 1e-5  # a mean of <= 80 same-sign cross-entropy terms: sum_rel(80) = 2 (4 + 79) u = 1e-5
# 12 Adam steps of lr 1e-4 x 2.5: each moves a weight by lr times its gradient's relative error, which is
# GRAD_REL_ERR of the tensor's largest over |g| >= 1e-2 of it for all but the noisiest elements: 12 lr 1e-2
WEIGHT_ATOL = 3e-5
SEED = 3


@pytest.fixture(scope="module")
def reference(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FineTuneResult:
    """The single-process co-served run (`LLM.fine_tune`) of the same job: 2 epochs of 4 steps."""
    llm = LLM(str(llama_dir), dtype="float32", max_batch_tokens=64, num_kv_blocks=160, block_size=8,
              max_model_len=256, max_lora_rank=8)
    return llm.fine_tune(EXAMPLES, str(tmp_path_factory.mktemp("reference")), {"n_epochs": 2, "batch_size": 4},
                         {"r": 4}, seed=SEED, validation=VALIDATION)


def _spec(llama_dir: Path, root: Path, n_epochs: int, examples: list[Any] = EXAMPLES,
          validation: list[Any] = VALIDATION, loss: LossSpec | None = None) -> RunSpec:
    from transformers import AutoTokenizer

    from coserve.model.config import ModelConfig

    prepared = prepare_job(AutoTokenizer.from_pretrained(llama_dir), examples, job_id="ftjob-dedicated",
                           tenant="t", adapter_id=1, num_layers=ModelConfig.from_pretrained(llama_dir).num_layers,
                           max_len=256, output_dir=root, seed=SEED,
                           hyperparameters=HyperparameterRequest(n_epochs=n_epochs, batch_size=4),
                           lora=LoRASettings(r=4), base_model_name_or_path=str(llama_dir), validation=validation,
                           loss=loss)
    return RunSpec(prepared.spec, str(llama_dir), "float32", storage_path=str(root), run_name="run-1", workers=2)


def _until(handle: Any, seen: list[RunUpdate], done: Any, timeout: float = 240) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while not any(done(u) for u in seen):
        what = ([n for u in seen for n in u.notes], [(e.kind.value, e.step) for u in seen for e in u.events])
        assert time.monotonic() < deadline, what
        assert not (seen and seen[-1].done), ("the run ended before the awaited update", what)
        update, _ = ray.get(handle.poll.remote())
        seen.append(update)
        time.sleep(0.2)


def _events(seen: list[RunUpdate], kind: JobEventKind) -> list[JobEvent]:
    return [e for u in seen for e in u.events if e.kind == kind]


def _adapter(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def test_dedicated_run_trains_what_the_coserved_trainer_trains(ray_cluster: None, llama_dir: Path,
                                                                reference: FineTuneResult, tmp_path: Path) -> None:
    """2 epochs of 4 steps: the reference's losses, and its step-8 checkpoint is this run's adapter."""
    import ray

    handle = launch(_spec(llama_dir, tmp_path / "job", n_epochs=2))
    seen: list[RunUpdate] = []
    _until(handle, seen, lambda u: u.done)
    (succeeded,) = _events(seen, JobEventKind.SUCCEEDED)
    steps = _events(seen, JobEventKind.STEP)
    assert [e.step for e in steps] == list(range(1, 9))  # 14 examples, batches of 4: 4 steps an epoch
    assert [e.loss for e in steps] == pytest.approx(reference.losses[:8], rel=LOSS_RTOL)
    assert [e.num_tokens for e in steps] == [e.num_tokens for e in reference.events
                                             if e.kind == JobEventKind.STEP][:8]
    validation = _events(seen, JobEventKind.VALIDATION)
    assert [e.loss for e in validation] == pytest.approx(reference.validation_losses[:2], rel=LOSS_RTOL)
    # Checkpoints through Ray Train, in the job's folder, in the co-served format (resumable, servable).
    checkpoints = _events(seen, JobEventKind.CHECKPOINT)
    assert [Path(e.path).relative_to(tmp_path / "job").as_posix() for e in checkpoints] == \
        ["run-1/ckpt-step-4", "run-1/ckpt-step-8"]
    assert read_trainer_state(checkpoints[-1].path).position.step == 8
    assert read_trainer_state(checkpoints[-1].path).trained_tokens == sum(e.num_tokens for e in steps)
    assert succeeded.path == str(tmp_path / "job" / "run-1" / "final")
    mine, theirs = _adapter(succeeded.path), _adapter(reference.checkpoints[1])
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(mine[name], tensor, rtol=0, atol=WEIGHT_ATOL)
    notes = [n for u in seen for n in u.notes]
    assert any(n.startswith("Ray Train started 2 worker(s) (gloo) from the start") for n in notes), notes
    assert seen[-1].done and ray.get(handle.poll.remote())[1] == sum(e.num_tokens for e in steps)


def _pair(i: int) -> dict[str, Any]:
    return {"input": {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}]},
            "preferred_output": [{"role": "assistant", "content": f"{2 * i}."}],
            "non_preferred_output": [{"role": "assistant", "content": f"Let me think: {i} and {i} is {2 * i}."}]}


def _kill_rank_1_after_the_first_checkpoint(handle: Any, seen: list[RunUpdate], root: Path) -> dict[int, int]:
    """Pause the run at a step boundary after its first checkpoint, wait until Ray Train registered it,
    SIGKILL rank 1 and let the run go on; returns the killed workers' pids by rank.

    The pause is asked for once step 2 is reported, while the workers run step 3 (the first epoch's
    last: its checkpoint, then validation): they pause after it, or, if this process is slow, at a
    later boundary, still six steps before the run's end (a CI run once asked only after the
    checkpoint, and the run finished before the pause reached it)."""
    _until(handle, seen, lambda u: any(e.kind == JobEventKind.STEP and e.step >= 2 for e in u.events))
    handle.command.remote(int(Command.PAUSE))
    _until(handle, seen, lambda u: any(n.startswith("Paused at step") for n in u.notes))
    assert _events(seen, JobEventKind.CHECKPOINT) and not seen[-1].done, [n for u in seen for n in u.notes]
    # Ray Train registers a reported checkpoint when its controller next polls the workers (every 2 s);
    # its run snapshot lists the registered ones. Kill only once one is: then the restart resumes from it.
    snapshot = root / "run-1" / "checkpoint_manager_snapshot.json"
    deadline = time.monotonic() + 60
    while not (snapshot.is_file() and json.loads(snapshot.read_text())["checkpoint_results"]):
        assert time.monotonic() < deadline, "Ray Train registered no checkpoint"
        time.sleep(0.2)
    workers = {w.rank: w.pid for w in seen[-1].workers}
    os.kill(workers[1], signal.SIGKILL)
    handle.command.remote(int(Command.RUN))
    return workers


def test_a_dpo_run_trains_what_the_coserved_dpo_job_trains_through_a_killed_worker(
        ray_cluster: None, llama_dir: Path, tmp_path: Path) -> None:
    """10 pairs, batches of 4, 3 epochs: the reference sums are computed once (the two ranks share them)
    and kept in the checkpoints. Rank 1 is killed while the run is paused after its first checkpoint:
    Ray Train's FailureConfig restarts both workers from it (with its reference sums), the job succeeds,
    and its losses, rewards, validation metrics and adapter are the co-served job's (`LLM.fine_tune` with
    the DPO loss, one process)."""
    pairs, validation, loss = [_pair(i) for i in range(10)], [_pair(20), _pair(21)], LossSpec(LossKind.DPO, beta=0.5)
    llm = LLM(str(llama_dir), dtype="float32", max_batch_tokens=64, num_kv_blocks=160, block_size=8,
              max_model_len=256, max_lora_rank=8)
    expected = llm.fine_tune(pairs, str(tmp_path / "reference"), {"n_epochs": 3, "batch_size": 4}, {"r": 4},
                             seed=SEED, validation=validation, loss=loss)
    handle = launch(_spec(llama_dir, tmp_path / "job", 3, pairs, validation, loss))
    seen: list[RunUpdate] = []
    killed = _kill_rank_1_after_the_first_checkpoint(handle, seen, tmp_path / "job")
    _until(handle, seen, lambda u: u.done)
    (succeeded,) = _events(seen, JobEventKind.SUCCEEDED)
    notes = [n for u in seen for n in u.notes]
    assert any(n.startswith("Ray Train worker") and "failed" in n for n in notes), notes
    restarted = [n for n in notes if n.startswith("Ray Train started 2 worker(s) (gloo) from its checkpoint")]
    assert restarted and {w.pid for w in seen[-1].workers}.isdisjoint(killed.values()), notes
    steps = {e.step: e for e in _events(seen, JobEventKind.STEP)}  # a step redone reports again: the last
    theirs = [e for e in expected.events if e.kind == JobEventKind.STEP]
    assert sorted(steps) == [e.step for e in theirs] == list(range(1, 10))
    for reference in theirs:
        mine = steps[reference.step]
        assert mine.num_tokens == reference.num_tokens and mine.metrics.keys() == reference.metrics.keys()
        # rewards: beta x a difference of sums of ~50, within numerics.dpo_margin_bound: beta (<= 1) x 4 sums
        # x 50 x sum_rel(20) = 5.5e-4; losses and log-prob means: no larger
        for key, value in reference.metrics.items():
            assert mine.metrics[key] == pytest.approx(value, rel=1e-4, abs=5.5e-4), (mine.step, key)
    validations = {e.step: e for e in _events(seen, JobEventKind.VALIDATION)}
    reference_validations = [e for e in expected.events if e.kind == JobEventKind.VALIDATION]
    assert sorted(validations) == [e.step for e in reference_validations] == [3, 6, 9]
    for reference in reference_validations:
        mine = validations[reference.step]
        assert mine.metrics["valid_loss"] == pytest.approx(reference.metrics["valid_loss"], abs=5.5e-4)  # as above
        assert mine.metrics["valid_rewards/accuracies"] == reference.metrics["valid_rewards/accuracies"]
    checkpoint = read_trainer_state(_events(seen, JobEventKind.CHECKPOINT)[-1].path)
    coserved = read_trainer_state(expected.checkpoints[-1])
    assert checkpoint.reference_logprobs.keys() == coserved.reference_logprobs.keys() == set(range(10))
    for index, sums in coserved.reference_logprobs.items():
        assert checkpoint.reference_logprobs[index] == pytest.approx(sums, rel=1e-5)  # sum_rel(<= 80 tokens)
    mine_adapter, reference_adapter = _adapter(succeeded.path), _adapter(expected.adapter_path)
    for name, tensor in reference_adapter.items():
        torch.testing.assert_close(mine_adapter[name], tensor, rtol=0, atol=WEIGHT_ATOL)
