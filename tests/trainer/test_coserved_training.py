"""Fine-tuning inside the engine's fused forward, driven by `CoservedJob` plans (fp32, CPU).

* Two optimizer steps of a job whose forward windows ride in the engine's fused forward (next to
  inference tokens) and whose tasklets read earlier K/V from the paged cache equal peft + AdamW, for
  several window schedules and two model families.
* Checkpoint resume reaches the weights of an uninterrupted run bit for bit; dropping sequences
  (KV blocks taken back) and pause/resume give the same weights to rounding.
* A NaN loss fails the job and the engine keeps serving; cancel frees everything.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from coserve.contract.data_position import DataPosition
from coserve.contract.engine_config import EngineConfig
from coserve.contract.job_spec import FinetuneJobSpec, JobState
from coserve.contract.plan import IterationPlan, NewSequence, ScheduledChunk
from coserve.contract.sampling import SamplingParams
from coserve.contract.training_plan import TrainingExample
from coserve.contract.training_settings import LoRASettings, OptimizerSettings
from coserve.finetune.job import CoservedJob
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.torch_engine.engine import TorchEngine
from coserve.trainer import LoRAOptimizer, TrainableLoRA, TrainingSequence, save_checkpoint
from train_reference import MAX_REL_ERR, check_weights, peft_adamw_run, rel_errs

LORA = LoRASettings(r=4, lora_alpha=8)
OPTIMIZER = OptimizerSettings(learning_rate_multiplier=1.0, weight_decay=0.01)
# (prompt, answer) lengths; 6 examples, batch 3: two optimizer steps per epoch.
SHAPES = [(12, 20), (9, 15), (20, 17), (5, 30), (14, 8), (7, 25)]
BATCH = 3
ALL = 10**9  # _drive's steps: until the job ends
Budget = Callable[[int], int]  # iteration -> forward tokens (backward token-layers: the same)


def _examples(vocab: int) -> list[TrainingExample]:
    g = torch.Generator().manual_seed(5)
    out = []
    for prompt, answer in SHAPES:
        ids = torch.randint(8, vocab, (prompt + answer,), generator=g).tolist()
        out.append(TrainingExample(ids, [False] * prompt + [True] * answer))
    return out


def _engine(model_dir: Path) -> TorchEngine:
    return TorchEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=48, block_size=8,
                               max_loras=2, max_lora_rank=8))


def _start_checkpoint(engine: TorchEngine, path: Path) -> dict[str, torch.Tensor]:
    """A step-0 checkpoint with random B (B = 0 would make the first step's dA zero)."""
    lora = TrainableLoRA.init(engine.model_config, LORA, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for b in lora.b.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.01)
    save_checkpoint(path, lora, LoRAOptimizer(lora, OPTIMIZER), DataPosition(seed=11))
    return {k: t.detach().clone() for k, t in lora.named_parameters().items()}


def _job(engine: TorchEngine, kv: KVBlockManager, slots: AdapterSlots, out: Path, resume: Path,
         position: DataPosition, n_epochs: int = 1, job_id: str = "job") -> CoservedJob:
    spec = FinetuneJobSpec(
        job_id=job_id, tenant="t", adapter_id=100, examples=_examples(engine.model_config.vocab_size),
        n_epochs=n_epochs, batch_size=BATCH, seed=11, num_layers=engine.model_config.num_layers,
        output_dir=str(out), optimizer=OPTIMIZER, min_tasklet_tokens=1,
        resume_from=str(resume), start_position=position)
    return CoservedJob(spec, kv, slots)


def _inference(engine: TorchEngine, kv: KVBlockManager, step: int, plan: IterationPlan) -> None:
    """A base-model request decoding next to the training work (a new one every 8 iterations)."""
    rid = f"r{step // 8}"
    length = 6 + step % 8
    if step % 8 == 0:
        if step > 0:  # the previous request ends
            plan.freed.append(f"r{step // 8 - 1}")
        prompt = [9 + step % 50] * 6
        plan.new_sequences.append(NewSequence(rid, prompt, SamplingParams(temperature=0)))
        kv.allocate_slots(rid, 6)
        plan.chunks.append(ScheduledChunk(rid, 0, 6, kv.block_table(rid), sample=True))
    else:
        kv.allocate_slots(rid, length)
        plan.chunks.append(ScheduledChunk(rid, length - 1, 1, kv.block_table(rid), sample=True))


def _drive(engine: TorchEngine, job: CoservedJob, kv: KVBlockManager, budget: Budget, steps: int,
           with_inference: bool = False,
           before: Callable[[int, IterationPlan], None] | None = None) -> list:
    """Iterate until the job has done `steps` optimizer steps (or ended); returns its events."""
    events = []
    for i in itertools.count():
        if job.state.is_finished or (job.position.step >= steps and job.state == JobState.RUNNING):
            return events
        assert i < 5000, "the job does not progress"
        plan = IterationPlan(step_id=i)
        if with_inference:
            _inference(engine, kv, i, plan)
        if before is not None:
            before(i, plan)
        job.schedule(plan, budget(i), budget(i))
        result = engine.step(plan)
        for rid in plan.freed:
            kv.free(rid)
        events.extend(job.update(plan, result))
    return events


def _weights(engine: TorchEngine, job_id: str = "job") -> dict[str, torch.Tensor]:
    lora = engine.training.jobs[job_id].lora
    return {k: t.detach().clone() for k, t in lora.named_parameters().items()}


def _reference_batches(examples: list[TrainingExample], steps: int) -> list[list[TrainingSequence]]:
    position, batches = DataPosition(seed=11), []
    for _ in range(steps):
        indices, position = position.next_batch(len(examples), BATCH)
        batches.append([TrainingSequence(torch.tensor(examples[i].token_ids),
                                         torch.tensor(examples[i].trained)) for i in indices])
    return batches


def _uneven(i: int) -> int:
    return random.Random(i).randint(1, 23)


SCHEDULES: dict[str, Budget] = {
    "one_window": lambda i: 10_000,
    "uniform16": lambda i: 16,
    "uneven": _uneven,
    "prompt_edge": lambda i: 12,  # the first example's answer starts at token 12: a window edge
}


# Every schedule on llama; on qwen3 (q/k norm, another head_dim) the two that cut windows unevenly.
GRID = [("llama", schedule) for schedule in SCHEDULES] + [("qwen3", "uniform16"), ("qwen3", "uneven")]


@pytest.mark.parametrize(("family", "schedule"), GRID)
def test_fused_training_steps_equal_peft(model_dirs: dict[str, Path], tmp_path: Path, family: str,
                                         schedule: str) -> None:
    model_dir = model_dirs[family]
    engine = _engine(model_dir)
    kv, slots = KVBlockManager(48, 8, enable_prefix_caching=False), AdapterSlots(2)
    init = _start_checkpoint(engine, tmp_path / "start")
    job = _job(engine, kv, slots, tmp_path / "out", tmp_path / "start", DataPosition(seed=11))
    events = _drive(engine, job, kv, SCHEDULES[schedule], steps=2, with_inference=True)

    reference = peft_adamw_run(model_dir, LORA, init, _reference_batches(job.spec.examples, 2),
                               OPTIMIZER)
    steps = [e for e in events if e.kind.value == "step"]
    assert [e.step for e in steps] == [1, 2]
    for event, ref in zip(steps, reference):
        assert event.grad_norm == pytest.approx(ref.norm, rel=1e-4)  # GRAD_REL_ERR, in the 2-norm (numerics)
    noisy = {k: g.abs() < 1e-4 * g.abs().max() for k, g in reference[-1].grads.items()}
    check_weights(_weights(engine), reference[-1].weights, noisy, bound=6 * OPTIMIZER.learning_rate)
    assert min(rel_errs(init, reference[-1].weights).values()) > 5 * MAX_REL_ERR  # it did move
    assert kv.num_free_blocks == kv.num_blocks - sum(  # only the live inference request holds blocks
        len(kv.block_table(r)) for r in (f"r{i}" for i in range(100)) if kv.has_table(r))


def test_checkpoint_resume_is_bit_identical_and_drops_are_exact(llama_dir: Path,
                                                                 tmp_path: Path) -> None:
    engine = _engine(llama_dir)
    kv, slots = KVBlockManager(48, 8, enable_prefix_caching=False), AdapterSlots(2)
    _start_checkpoint(engine, tmp_path / "start")
    start = DataPosition(seed=11)
    budget = SCHEDULES["uniform16"]

    whole = _job(engine, kv, slots, tmp_path / "a", tmp_path / "start", start, n_epochs=2,
                 job_id="whole")
    events = _drive(engine, whole, kv, budget, steps=ALL)
    assert whole.state == JobState.SUCCEEDED and kv.num_free_blocks == kv.num_blocks
    checkpoints = [e.path for e in events if e.kind.value == "checkpoint"]
    assert checkpoints == [f"{tmp_path}/a/ckpt-step-2", f"{tmp_path}/a/ckpt-step-4"]
    final = TrainableLoRA.from_pretrained(tmp_path / "a" / "final", engine.model_config)
    expected = {k: t.detach() for k, t in final.named_parameters().items()}
    assert "whole" not in engine.training.jobs  # dropped after the final save

    # Resume from the epoch-1 checkpoint: the same weights, bit for bit.
    resumed = _job(engine, kv, slots, tmp_path / "b", Path(checkpoints[0]),
                   DataPosition(seed=11, epoch=1, index=0, step=2), n_epochs=2, job_id="resumed")
    _drive(engine, resumed, kv, budget, steps=ALL)
    got = TrainableLoRA.from_pretrained(tmp_path / "b" / "final", engine.model_config)
    assert all(torch.equal(t.detach(), expected[k]) for k, t in got.named_parameters().items())

    # Sequences dropped mid-forward and mid-backward (KV given back), and a pause: same weights.
    def interrupt(i: int, plan: IterationPlan) -> None:
        if i % 7 == 3:
            dropping.release_kv(plan)
        if i == 20:
            dropping.pause(plan)
        if i == 24:
            dropping.resume()

    dropping = _job(engine, kv, slots, tmp_path / "c", tmp_path / "start", start, n_epochs=2,
                    job_id="dropping")
    _drive(engine, dropping, kv, budget, steps=ALL, before=interrupt)
    got = TrainableLoRA.from_pretrained(tmp_path / "c" / "final", engine.model_config)
    errors = rel_errs({k: t.detach() for k, t in got.named_parameters().items()}, expected)
    assert max(errors.values()) <= MAX_REL_ERR
    assert kv.num_free_blocks == kv.num_blocks


def test_nan_loss_fails_the_job_and_cancel_frees_everything(llama_dir: Path, tmp_path: Path) -> None:
    engine = _engine(llama_dir)
    kv, slots = KVBlockManager(48, 8, enable_prefix_caching=False), AdapterSlots(2)
    lora = TrainableLoRA.init(engine.model_config, LORA, seed=3)
    with torch.no_grad():
        next(iter(lora.b.values())).fill_(float("nan"))
    save_checkpoint(tmp_path / "nan", lora, LoRAOptimizer(lora, OPTIMIZER), DataPosition(seed=11))
    job = _job(engine, kv, slots, tmp_path / "out", tmp_path / "nan", DataPosition(seed=11))
    events = _drive(engine, job, kv, SCHEDULES["uniform16"], steps=2, with_inference=True)
    assert job.state == JobState.FAILED and events[-1].code == "non_finite_loss"
    assert "nan" in events[-1].message and not engine.training.jobs
    assert slots.pin_count(100) == 0

    # The engine still serves: a request decodes through the base model.
    engine.step(IterationPlan(step_id=1000, new_sequences=[NewSequence("x", [9] * 5, SamplingParams())],
                              chunks=[ScheduledChunk("x", 0, 5, [0], sample=True)]))

    _start_checkpoint(engine, tmp_path / "start")
    kv = KVBlockManager(48, 8, enable_prefix_caching=False)  # without the inference requests' blocks
    job = _job(engine, kv, slots, tmp_path / "out2", tmp_path / "start", DataPosition(seed=11),
               job_id="cancelled")
    _drive(engine, job, kv, SCHEDULES["uniform16"], steps=1)
    plan = IterationPlan(step_id=2000)
    event = job.cancel(plan)
    engine.step(plan)
    assert event is not None and job.state == JobState.CANCELLED
    assert not engine.training.jobs and not engine.training.sequences
    assert kv.num_free_blocks == kv.num_blocks and slots.pin_count(100) == 0


def test_a_sequence_that_can_never_fit_the_kv_pool_fails_the_job(llama_dir: Path, tmp_path: Path) -> None:
    engine = _engine(llama_dir)
    kv, slots = KVBlockManager(4, 8, enable_prefix_caching=False), AdapterSlots(2)  # 32 tokens
    _start_checkpoint(engine, tmp_path / "start")
    job = _job(engine, kv, slots, tmp_path / "out", tmp_path / "start", DataPosition(seed=11))
    events = _drive(engine, job, kv, SCHEDULES["uniform16"], steps=ALL)
    assert job.state == JobState.FAILED and events[-1].code == "sequence_too_long"
    assert not engine.training.jobs and kv.num_free_blocks == kv.num_blocks
