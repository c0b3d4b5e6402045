"""The training loop of one Ray Train worker of a dedicated fine-tuning run.

Every worker loads the base model and the job's trainable adapter (`build_trainable`: the same init,
resume and fine-tuned-model start as the co-served trainer), then walks the job's data exactly as the
scheduler's `CoservedJob` does: epochs of `DataPosition.next_batch` batches (the same seeded order), one
clipped AdamW step per batch, a resumable checkpoint at each epoch's end, the validation loss after it,
the PEFT adapter after the last epoch. A batch is trained data-parallel (`ProcessGroupSync`: the ranks
share its sequences, the gradients are all-reduced), so every rank takes the step one process would.
A DPO job's batches are pairs (`trainer.preference_step`): each pair's reference sums are computed once
(the adapter off, the ranks sharing the work), kept for later epochs and written with each checkpoint.

Checkpoints go through Ray Train (`ray.train.report(..., checkpoint_dir_name="ckpt-step-N")`), which
persists them under the run's storage path (the job's adapter folder in the data dir) and hands the
latest back (`ray.train.get_checkpoint`) when it restarts the workers after a failure. Rank 0 tells the
run's `DedicatedRun` actor what happened (`JobEvent`s, as the co-served job reports them) after every
step and gets back the command every rank then agrees on (run, pause, stop, or release: a checkpoint at
this step, then the workers end).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coserve.contract.data_position import DataPosition
from coserve.contract.dedicated_run import Command, RunSpec, WorkerInfo
from coserve.contract.job_spec import JobEvent, JobEventKind

PAUSE_POLL_S = 1.0  # how often a paused run asks whether it may go on
FINAL_DIR = "final"


@dataclass(slots=True)
class _Worker:
    """What one worker holds while it trains."""

    spec: RunSpec
    control: Any  # the DedicatedRun actor's handle
    rank: int
    sync: Any  # ProcessGroupSync
    trainer: Any  # WindowedTrainer
    optimizer: Any  # LoRAOptimizer
    sequences: list[Any]  # TrainingSequence per training example (a DPO job: PreferencePair per pair)
    validation: list[Any]
    position: DataPosition
    trained_tokens: int
    pending: list[JobEvent]
    references: dict[int, tuple[float, float]]  # a DPO job's reference sums (pair index -> chosen, rejected)
    start_step: int = 0  # the step this attempt started from (its checkpoint, if any, exists already)


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function (`TorchTrainer(train_loop, train_loop_config=...)`).

    `config`: `spec` (an ObjectRef of the `RunSpec`) and `control` (the `DedicatedRun` handle).
    """
    import ray

    spec: RunSpec = ray.get(config["spec"])
    worker = _set_up(spec, config["control"])
    if worker is None:
        return
    job = spec.job
    while worker.position.epoch < job.n_epochs:
        command = _agree(worker)
        if command == Command.RELEASE:
            _release(worker)
        if command in (Command.STOP, Command.RELEASE):
            return
        if not _train_step(worker):
            return
    if _agree(worker) != Command.STOP:  # a release here finishes instead: the job is done
        _finish(worker)


def _set_up(spec: RunSpec, control: Any) -> _Worker | None:
    """Load the model and the adapter (from Ray Train's latest checkpoint after a worker failure, else
    the job's own start); None when this run already wrote the final adapter."""
    import ray.train
    import ray.train.torch

    from coserve.contract.trainer_state import STATE_FILE, read_trainer_state
    from coserve.trainer import WindowedTrainer
    from coserve.trainer.data_parallel import ProcessGroupSync
    from coserve.trainer.setup import build_trainable

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    job, resume_from = spec.job, spec.job.resume_from
    position = job.start_position or DataPosition(seed=job.seed)
    trained_tokens, references = job.start_trained_tokens, dict(job.reference_logprobs)
    checkpoint = ray.train.get_checkpoint()  # set when Ray Train restarted the workers after a failure
    if checkpoint is not None:
        folder = Path(checkpoint.path)
        if not (folder / STATE_FILE).is_file():  # the final adapter: the run had finished
            if rank == 0:
                ray.get(control.push.remote([_succeeded(job.job_id, position.step, folder)]))
            return None
        state = read_trainer_state(folder)
        resume_from, position, trained_tokens = str(folder), state.position, state.trained_tokens or 0
        references = state.reference_logprobs
    model = _load_model(spec.model, spec.dtype, device)
    try:
        lora, optimizer = build_trainable(model.cfg, device, job.lora, job.optimizer, job.seed,
                                          resume_from, job.init_adapter)
    except (OSError, ValueError, TypeError, KeyError) as err:
        if rank == 0:
            ray.get(control.push.remote([JobEvent(job.job_id, JobEventKind.FAILED, position.step,
                                                  code="invalid_job", message=f"cannot set up the job's "
                                                  f"adapter: {err}")]))
        return None

    sync = ProcessGroupSync(rank, world, device)
    worker = _Worker(spec, control, rank, sync, WindowedTrainer(model, lora), optimizer,
                     _units(job.examples, job.rejected_examples, job.is_preference, device),
                     _units(job.validation_examples, job.validation_rejected, job.is_preference, device),
                     position, trained_tokens, [], references, start_step=position.step)
    _announce(worker, world, checkpoint is not None)
    return worker


def _units(examples: list[Any], rejected: list[Any], preference: bool, device: Any) -> list[Any]:
    """The examples as `TrainingSequence`s, or a DPO job's as `PreferencePair`s with their rejected sides."""
    import torch

    from coserve.trainer import TrainingSequence
    from coserve.trainer.preference_step import PreferencePair

    def tensors(e: Any) -> TrainingSequence:
        return TrainingSequence(torch.tensor(e.token_ids, dtype=torch.int64, device=device),
                                torch.tensor(e.trained, dtype=torch.bool, device=device))

    if preference:
        return [PreferencePair(tensors(c), tensors(r)) for c, r in zip(examples, rejected, strict=True)]
    return [tensors(e) for e in examples]


def _load_model(model_dir: str, dtype: str, device: Any) -> Any:
    from coserve.forward.transformer import Transformer
    from coserve.model.config import ModelConfig, resolve_dtype
    from coserve.model.weights import load_weights

    cfg = ModelConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    return Transformer(cfg, load_weights(Path(model_dir), cfg, torch_dtype, device), torch_dtype, device)


def _announce(worker: _Worker, world: int, restored: bool) -> None:
    """Rank 0 tells the run which workers train (rank, host, pid) and where they start."""
    import ray
    import torch.distributed as dist

    mine = WorkerInfo(worker.rank, socket.gethostname(), os.getpid())
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if worker.rank != 0:
        return
    where = (f"from its checkpoint at step {worker.position.step}" if restored or worker.spec.job.resume_from
             else "from the start")
    note = (f"Ray Train started {world} worker(s) ({dist.get_backend()}) {where}: "
            + ", ".join(f"rank {w.rank} pid {w.pid} on {w.host}" for w in everyone))
    group = ray.util.get_current_placement_group()
    ray.get(worker.control.started.remote(everyone, note, None if group is None else group.id.hex()))


def _agree(worker: _Worker) -> Command:
    """Hand rank 0's pending events to the run and agree on its command at this step boundary; while it
    says pause, every rank waits here (rank 0 asking again every `PAUSE_POLL_S`)."""
    import ray

    paused = False
    while True:
        command = Command.RUN
        if worker.rank == 0:
            command = Command(ray.get(worker.control.push.remote(worker.pending, worker.trained_tokens)))
            worker.pending = []
            if command == Command.PAUSE and not paused:
                worker.control.note.remote(f"Paused at step {worker.position.step}: the Ray Train workers "
                                           f"wait at this step boundary")
        command = Command(worker.sync.broadcast(int(command)))
        if command != Command.PAUSE:
            return command
        paused = True
        if worker.rank == 0:
            time.sleep(PAUSE_POLL_S)


def _release(worker: _Worker) -> None:
    """The run was paused past the server's timeout: a checkpoint at this step boundary (none when this
    attempt trained no step: it started from one), handed to the run; then the workers end, and Ray Train
    gives their resources back. Resuming the job starts a new run from that checkpoint."""
    import ray

    if worker.position.step > worker.start_step:
        _checkpoint(worker)
    if worker.rank == 0:
        ray.get(worker.control.push.remote(worker.pending, worker.trained_tokens))
        worker.pending = []


def _train_step(worker: _Worker) -> bool:
    """One optimizer step; at an epoch's end a checkpoint and the validation loss. False: the job failed
    (the event is pending)."""
    from coserve.trainer import NonFiniteGradientError, train_batch

    job, before = worker.spec.job, worker.position
    indices, after = before.next_batch(len(job.examples), job.batch_size)
    metrics: dict[str, float] = {}
    try:
        if job.is_preference:
            stats, metrics = _preference_step(worker, indices)
        else:
            stats = train_batch(worker.trainer, worker.optimizer, [worker.sequences[i] for i in indices],
                                worker.sync)
    except NonFiniteGradientError as err:
        worker.pending.append(JobEvent(job.job_id, JobEventKind.FAILED, before.step, code=err.code,
                                       message=f"{err}; the job stopped"))
        _agree(worker)
        return False
    worker.trained_tokens += stats.num_tokens
    worker.position = after
    worker.pending.append(JobEvent(job.job_id, JobEventKind.STEP, stats.step, loss=stats.loss,
                                   grad_norm=stats.grad_norm, learning_rate=stats.learning_rate,
                                   num_tokens=stats.num_tokens, metrics=metrics))
    if after.epoch > before.epoch:
        _checkpoint(worker)
        if worker.validation:
            _validate(worker)
    return True


def _preference_step(worker: _Worker, indices: list[int]) -> tuple[Any, dict[str, float]]:
    """A DPO batch: the pairs' reference sums (those not known yet), then the step."""
    from coserve.trainer.preference_step import fill_references, train_preference_batch

    fill_references(worker.trainer, worker.sequences, indices, worker.references, worker.sync)
    return train_preference_batch(worker.trainer, worker.optimizer, [worker.sequences[i] for i in indices],
                                  [worker.references[i] for i in indices], worker.spec.job.loss.beta,
                                  worker.sync)


def _report(worker: _Worker, name: str, write: Any, metrics: dict[str, Any]) -> Path:
    """Write a folder on rank 0 (`write(path)`) and persist it through Ray Train as `name` under the
    run's storage path; every rank reports (Ray Train's report is a barrier). Returns where it is.

    A checkpoint this run already persisted complete (a step redone after a worker failure that came
    before Ray Train registered it) is not copied again: it may be served already, and a copy is not
    atomic; its content would be the same (the redone steps are the same arithmetic).
    """
    import ray.train

    from coserve.contract.trainer_state import STATE_FILE

    target = Path(worker.spec.storage_path) / worker.spec.run_name / name
    if worker.rank != 0 or (name != FINAL_DIR and (target / STATE_FILE).is_file()):
        ray.train.report(metrics, checkpoint=None)
    else:
        with tempfile.TemporaryDirectory(prefix="coserve-dedicated-") as tmp:
            folder = Path(tmp) / name
            write(folder)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(folder)),
                             checkpoint_dir_name=name)
    return target


def _checkpoint(worker: _Worker) -> None:
    from coserve.trainer.checkpoint import save_checkpoint

    job, position = worker.spec.job, worker.position
    path = _report(worker, f"ckpt-step-{position.step}",
                   lambda folder: save_checkpoint(folder, worker.trainer.lora, worker.optimizer, position,
                                                  job.base_model_name_or_path, worker.trained_tokens,
                                                  worker.references if job.is_preference else None),
                   {"step": position.step, "epoch": position.epoch})
    worker.pending.append(JobEvent(job.job_id, JobEventKind.CHECKPOINT, position.step, path=str(path),
                                   epoch=position.epoch, message=f"checkpoint at step {position.step}"))


def _validate(worker: _Worker) -> None:
    from coserve.trainer.data_parallel import evaluation_loss
    from coserve.trainer.preference_step import preference_validation

    job, metrics = worker.spec.job, {}
    if job.is_preference:  # as the co-served job reports it: the pairs' mean DPO loss, and its rewards
        metrics = preference_validation(worker.trainer, worker.validation, job.loss.beta, worker.sync)
        loss_sum, tokens = metrics["valid_loss"], 1
    else:
        loss_sum, tokens = evaluation_loss(worker.trainer, worker.validation, worker.sync)
    step = worker.position.step
    worker.pending.append(JobEvent(job.job_id, JobEventKind.VALIDATION, step,
                                   loss=loss_sum / max(1, tokens), num_tokens=tokens, metrics=metrics,
                                   message=f"validation loss after step {step}"))


def _finish(worker: _Worker) -> None:
    """The fine-tuned adapter (PEFT folder), persisted like the checkpoints; then the job succeeded."""
    import ray

    job = worker.spec.job
    path = _report(worker, FINAL_DIR, lambda folder: worker.trainer.lora.save_pretrained(
        folder, job.base_model_name_or_path), {"step": worker.position.step, "final": True})
    if worker.rank == 0:
        ray.get(worker.control.push.remote([_succeeded(job.job_id, worker.position.step, path)],
                                           worker.trained_tokens))


def _succeeded(job_id: str, step: int, path: Path) -> JobEvent:
    return JobEvent(job_id, JobEventKind.SUCCEEDED, step, path=str(path), message="the job succeeded")
