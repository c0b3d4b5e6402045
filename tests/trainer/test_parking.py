"""A driven run parked between its calls (`finetune.run_parking`, `trainer.parking`) on the real engine (fp32,
CPU, the tiny llama): its slot goes back to the bank, its state (weights, gradient half-way between a
forward_backward and its optim_step, AdamW moments) comes back into another slot bit for bit, and its
next calls land exactly where a run that never parked does."""

from __future__ import annotations

from pathlib import Path

import torch

from coserve.contract.engine_config import EngineConfig
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.loss_spec import LossSpec, TokenInputs
from coserve.contract.plan import IterationPlan
from coserve.contract.sampling import AdapterRef
from coserve.contract.training_calls import ForwardBackwardCall, OptimStepCall, TrainingDatum
from coserve.contract.training_settings import AdamStep, LoRASettings
from coserve.finetune.driven_ops import DrivenOp, driven_calls
from coserve.finetune.job import CoservedJob
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.torch_engine.engine import TorchEngine


def run_calls(model_dir: Path, tmp_path: Path, park_between: bool) -> dict[str, torch.Tensor]:
    """One run: forward_backward, (parked, then another adapter takes its slot,) forward_backward,
    optim_step, forward_backward, optim_step; returns its final weights."""
    engine = TorchEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=8,
                                      max_loras=2, max_lora_rank=8))
    kv, slots = KVBlockManager(64, 8), AdapterSlots(2)
    spec = FinetuneJobSpec(job_id="run", tenant="t", adapter_id=100, examples=[], n_epochs=1, batch_size=1,
                           seed=3, num_layers=engine.model_config.num_layers, output_dir=str(tmp_path),
                           lora=LoRASettings(r=4), loss=LossSpec(), driven=True)
    job = CoservedJob(spec, kv, slots)
    calls = driven_calls(job.source)
    assert calls is not None and job.parking is not None
    step = 0

    def plan_once() -> IterationPlan:
        nonlocal step
        step += 1
        plan = IterationPlan(step)
        job.settle(plan)
        if job.has_work:  # as the roster asks it
            job.schedule(plan, 10_000, 10**6)
        job.update(plan, engine.step(plan))
        return plan

    def call(made: ForwardBackwardCall | OptimStepCall) -> None:
        op = DrivenOp(f"c{step}", made, 0.0)
        calls.submit(op)
        for _ in range(100):
            if op.done:
                break
            plan_once()
        assert op.outcome is not None and not hasattr(op.outcome, "code"), op.outcome

    tokens = list(range(5, 40))
    fb = ForwardBackwardCall([TrainingDatum(tokens, TokenInputs(weights=[0.0] + [1.0] * (len(tokens) - 1)))],
                             LossSpec())
    call(fb)
    if park_between:
        slots.misses += 1  # someone waited for a slot: the idle run parks in the next plan
        assert plan_once().training.job_parks == ["run"] and job.parking.parked
        assert "run" in engine.training.parked and "run" not in engine.training.jobs
        assert slots.available == 2 and engine.bank.slots == [None, None]
        grant = slots.acquire(AdapterRef(7, "other", "other"))  # another adapter takes a slot meanwhile
        assert grant is not None
        slots.release(7)  # and stays resident, unpinned (a run leaves one slot to requests: it takes the other)
    call(fb)  # unparked into slot 1 (or 0): the gradient of the first call is still there
    call(OptimStepCall(AdamStep(1e-2)))
    call(fb)
    call(OptimStepCall(AdamStep(1e-2)))
    state = engine.training.jobs["run"]
    return {k: v.detach().clone() for k, v in state.lora.named_parameters().items()}


def test_a_parked_run_comes_back_bit_for_bit(llama_dir: Path, tmp_path: Path) -> None:
    straight = run_calls(llama_dir, tmp_path / "a", park_between=False)
    parked = run_calls(llama_dir, tmp_path / "b", park_between=True)
    assert straight.keys() == parked.keys()
    for key in straight:
        assert torch.equal(straight[key], parked[key]), key
