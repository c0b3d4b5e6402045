"""A dedicated fine-tuning run on real Ray Train: 2 CPU workers (gloo), on the package's one cluster
(`conftest.ray_cluster`). The run trains what the co-served trainer trains (the single-process `LLM.fine_tune`
is the reference, fp32, same seed), checkpoints through Ray Train into the job's folder, and comes back
from a killed worker through Ray Train's FailureConfig."""

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
from coserve.contract.trainer_state import read_trainer_state
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings
from coserve.dedicated.run import launch
from coserve.frontend.job_prep import prepare_job
from coserve.offline.finetune import FineTuneResult

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXAMPLES = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(14)]
VALIDATION = [{"messages": [{"role": "user", "content": "What is 20 plus 20?"},
                            {"role": "assistant", "content": "20 plus 20 is 40."}]}]
# fp32 on both sides; the 2 workers sum their halves of each batch's gradient in another order than one
# process accumulates it (and use dense K/V where the engine pages them), and the curve compounds that
# rounding over the steps. Measured (12 steps, 2026-11-25): loss <= 1.1e-7 relative, adapter weights
# (|w| <= 0.09) <= 3e-7 absolute. The bounds keep a 100x margin, far below what a wrong batch, a missed
# gradient shard or a mean instead of a sum over the ranks would change (whole percents).
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 3e-5
SEED = 3


@pytest.fixture(scope="module")
def reference(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FineTuneResult:
    """The single-process co-served run (`LLM.fine_tune`) of the same job: 3 epochs of 4 steps."""
    llm = LLM(str(llama_dir), dtype="float32", max_batch_tokens=64, num_kv_blocks=160, block_size=8,
              max_model_len=256, max_lora_rank=8)
    return llm.fine_tune(EXAMPLES, str(tmp_path_factory.mktemp("reference")), {"n_epochs": 3, "batch_size": 4},
                         {"r": 4}, seed=SEED, validation=VALIDATION)


def _spec(llama_dir: Path, root: Path, n_epochs: int) -> RunSpec:
    from transformers import AutoTokenizer

    from coserve.model.config import ModelConfig

    prepared = prepare_job(AutoTokenizer.from_pretrained(llama_dir), EXAMPLES, job_id="ftjob-dedicated",
                           tenant="t", adapter_id=1, num_layers=ModelConfig.from_pretrained(llama_dir).num_layers,
                           max_len=256, output_dir=root, seed=SEED,
                           hyperparameters=HyperparameterRequest(n_epochs=n_epochs, batch_size=4),
                           lora=LoRASettings(r=4), base_model_name_or_path=str(llama_dir), validation=VALIDATION)
    return RunSpec(prepared.spec, str(llama_dir), "float32", storage_path=str(root), run_name="run-1", workers=2)


def _until(handle: Any, seen: list[RunUpdate], done: Any, timeout: float = 240) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while not any(done(u) for u in seen):
        assert time.monotonic() < deadline, [n for u in seen for n in u.notes]
        update, _ = ray.get(handle.poll.remote())
        seen.append(update)
        time.sleep(0.2)


def _events(seen: list[RunUpdate], kind: JobEventKind) -> list[JobEvent]:
    return [e for u in seen for e in u.events if e.kind == kind]


def _last_per_step(events: list[JobEvent]) -> list[float]:
    """One loss per step, the last reported (a step redone after a failure reports again)."""
    by_step = {e.step: e.loss for e in events}
    return [by_step[s] for s in sorted(by_step)]


def _adapter(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def test_dedicated_run_trains_what_the_coserved_trainer_trains(ray_cluster: None, llama_dir: Path,
                                                                reference: FineTuneResult, tmp_path: Path) -> None:
    """2 epochs: the first 8 steps of the 3-epoch reference, whose step-8 checkpoint is this run's adapter."""
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


def test_a_killed_worker_is_replaced_from_the_checkpoint(ray_cluster: None, llama_dir: Path,
                                                         reference: FineTuneResult, tmp_path: Path) -> None:
    """Rank 1 is killed while the run is paused after its first checkpoint: Ray Train's FailureConfig
    restarts both workers from that checkpoint, the job succeeds, and the steps it redid give the losses
    an uninterrupted run gives."""

    handle = launch(_spec(llama_dir, tmp_path / "job", n_epochs=3))
    seen: list[RunUpdate] = []
    _until(handle, seen, lambda u: any(e.kind == JobEventKind.CHECKPOINT for e in u.events))
    handle.command.remote(int(Command.PAUSE))
    _until(handle, seen, lambda u: any(n.startswith("Paused at step") for n in u.notes))
    # Ray Train registers a reported checkpoint when its controller next polls the workers (every 2 s);
    # its run snapshot lists the registered ones. Kill only once one is: then the restart resumes from it.
    snapshot = tmp_path / "job" / "run-1" / "checkpoint_manager_snapshot.json"
    deadline = time.monotonic() + 60
    while not (snapshot.is_file() and json.loads(snapshot.read_text())["checkpoint_results"]):
        assert time.monotonic() < deadline, "Ray Train registered no checkpoint"
        time.sleep(0.2)
    paused_at = len(_events(seen, JobEventKind.STEP))
    assert 4 <= paused_at < 12, paused_at  # after the first checkpoint, before the end
    workers = {w.rank: w.pid for w in seen[-1].workers}
    os.kill(workers[1], signal.SIGKILL)
    handle.command.remote(int(Command.RUN))
    _until(handle, seen, lambda u: u.done)

    assert len(_events(seen, JobEventKind.SUCCEEDED)) == 1, [e for u in seen for e in u.events]
    notes = [n for u in seen for n in u.notes]
    assert any(n.startswith("Ray Train worker") and "failed" in n for n in notes), notes
    restarted = [n for n in notes if n.startswith("Ray Train started 2 worker(s) (gloo) from its checkpoint")]
    assert restarted and {w.pid for w in seen[-1].workers}.isdisjoint(workers.values()), notes
    assert _last_per_step(_events(seen, JobEventKind.STEP)) == pytest.approx(reference.losses, rel=LOSS_RTOL)
    assert [e.step for e in _events(seen, JobEventKind.CHECKPOINT)][-1] == 12
