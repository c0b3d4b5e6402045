"""DPO inside the engine's fused forward, driven by `CoservedJob` plans, against peft + TRL's loss + AdamW
(fp32, CPU).

A DPO job of 4 pairs (batch 2: two optimizer steps) trains next to a decoding request, under uneven
budgets: its reference passes run through the base model (the adapter's bank slot off) in the same
fused forwards, both trained sequences of a pair run forward before either backward, and the pair's
coefficient scales their gradients in between. The reference is written plainly: peft's full-sequence
log-probs, the reference with `disable_adapter()`, TRL's sigmoid loss averaged over the batch's pairs,
`clip_grad_norm_` and `torch.optim.AdamW`. Also: each pair's reference sums are computed once (a
second epoch runs no reference pass), kept in the epoch's checkpoint, and dropping KV mid-pair
(inference taking blocks back) gives the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from test_coserved_training import LORA, OPTIMIZER, SCHEDULES, _drive, _engine, _start_checkpoint, _weights
from transformers import AutoModelForCausalLM

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import FinetuneJobSpec, JobState
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.plan import IterationPlan
from coserve.contract.trainer_state import read_trainer_state
from coserve.contract.training_plan import TrainingExample
from coserve.finetune.job import CoservedJob
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from numerics import dpo_loss_bound
from train_reference import MAX_REL_ERR, check_weights, rel_errs

BETA = 0.5
PAIRS = [(10, 14, 9), (6, 20, 12), (15, 8, 11), (8, 11, 17)]  # (prompt, chosen, rejected) lengths
BATCH = 2


def _pairs(vocab: int) -> tuple[list[TrainingExample], list[TrainingExample]]:
    g = torch.Generator().manual_seed(8)
    chosen, rejected = [], []
    for prompt, good, bad in PAIRS:
        context = torch.randint(8, vocab, (prompt,), generator=g).tolist()
        for answer, out in ((good, chosen), (bad, rejected)):
            ids = context + torch.randint(8, vocab, (answer,), generator=g).tolist()
            out.append(TrainingExample(ids, [False] * prompt + [True] * answer))
    return chosen, rejected


def _dpo_job(engine, kv: KVBlockManager, out: Path, start: Path, n_epochs: int = 1,  # type: ignore[no-untyped-def]
             job_id: str = "dpo") -> CoservedJob:
    chosen, rejected = _pairs(engine.model_config.vocab_size)
    spec = FinetuneJobSpec(
        job_id=job_id, tenant="t", adapter_id=100, examples=chosen, rejected_examples=rejected,
        loss=LossSpec(LossKind.DPO, beta=BETA), n_epochs=n_epochs, batch_size=BATCH, seed=11,
        num_layers=engine.model_config.num_layers, output_dir=str(out), optimizer=OPTIMIZER,
        min_tasklet_tokens=1, resume_from=str(start), start_position=DataPosition(seed=11))
    return CoservedJob(spec, kv, AdapterSlots(2))


def _logprob_sum(model: torch.nn.Module, example: TrainingExample) -> torch.Tensor:
    ids = torch.tensor(example.token_ids)
    logits = model(input_ids=ids[None]).logits[0, :-1].float()
    picked = F.log_softmax(logits, dim=-1).gather(1, ids[1:, None]).squeeze(1)
    return (picked * torch.tensor(example.trained[1:]).float()).sum()


def _reference_run(model_dir: Path, init: dict[str, torch.Tensor], steps: int
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float], list[float]]:
    """Weights after `steps` steps, the last step's gradient, each step's loss, and each step's bound on
    the fp32 rounding of its loss (`numerics.dpo_loss_bound`, from this step's log-prob sums)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(hf, LoraConfig(r=LORA.r, lora_alpha=LORA.lora_alpha, lora_dropout=0.0,
                                          target_modules=list(LORA.target_modules)))
    params = {n.replace(".default.weight", ".weight"): p for n, p in model.named_parameters()
              if p.requires_grad}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(init[name])
    adamw = torch.optim.AdamW(params.values(), lr=OPTIMIZER.learning_rate, betas=OPTIMIZER.betas,
                              eps=OPTIMIZER.eps, weight_decay=OPTIMIZER.weight_decay)
    chosen, rejected = _pairs(hf.config.vocab_size)
    position, losses, bounds, grads = DataPosition(seed=11), [], [], {}
    for _ in range(steps):
        indices, position = position.next_batch(len(chosen), BATCH)
        with torch.no_grad(), model.disable_adapter():
            refs = [(_logprob_sum(model, chosen[i]), _logprob_sum(model, rejected[i])) for i in indices]
        total, rounding = torch.zeros(()), []
        for i, (ref_c, ref_r) in zip(indices, refs):
            pi_c, pi_r = _logprob_sum(model, chosen[i]), _logprob_sum(model, rejected[i])
            total = total - F.logsigmoid(BETA * ((pi_c - ref_c) - (pi_r - ref_r))) / len(indices)
            counts = [sum(chosen[i].trained[1:]), sum(rejected[i].trained[1:])] * 2
            rounding.append(([float(pi_c), float(pi_r), float(ref_c), float(ref_r)], counts))
        total.backward()
        losses.append(float(total))
        bounds.append(dpo_loss_bound(rounding, BETA, len(indices)))
        grads = {name: p.grad.clone() for name, p in params.items()}
        torch.nn.utils.clip_grad_norm_(params.values(), OPTIMIZER.max_grad_norm)
        adamw.step()
        adamw.zero_grad()
    return {name: p.detach().clone() for name, p in params.items()}, grads, losses, bounds


@pytest.mark.parametrize("schedule", ["one_window", "uneven"])
def test_coserved_dpo_steps_equal_peft_with_trls_loss(model_dirs: dict[str, Path], tmp_path: Path,
                                                      schedule: str) -> None:
    model_dir = model_dirs["llama"]
    engine = _engine(model_dir)
    kv = KVBlockManager(48, 8, enable_prefix_caching=False)
    init = _start_checkpoint(engine, tmp_path / "start")
    job = _dpo_job(engine, kv, tmp_path / "out", tmp_path / "start")
    events = _drive(engine, job, kv, SCHEDULES[schedule], steps=2, with_inference=True)
    weights, grads, losses, bounds = _reference_run(model_dir, init, steps=2)
    steps = [e for e in events if e.kind.value == "step"]
    assert [e.step for e in steps] == [1, 2]
    for event, loss, bound in zip(steps, losses, bounds):
        assert event.loss == pytest.approx(loss, abs=bound)  # the sums' rounding through the loss (numerics)
        assert set(event.metrics) >= {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                      "rewards/margins", "train_loss"}
    noisy = {k: g.abs() < 1e-4 * g.abs().max() for k, g in grads.items()}
    check_weights(_weights(engine, "dpo"), weights, noisy, bound=6 * OPTIMIZER.learning_rate)
    assert min(rel_errs(init, weights).values()) > 5 * MAX_REL_ERR  # it did move
    assert job.trained_tokens == sum(c + r for _, c, r in PAIRS)  # both sides of each pair


def test_references_are_computed_once_and_kept_in_checkpoints(llama_dir: Path, tmp_path: Path) -> None:
    engine = _engine(llama_dir)
    kv = KVBlockManager(48, 8, enable_prefix_caching=False)
    _start_checkpoint(engine, tmp_path / "start")
    job = _dpo_job(engine, kv, tmp_path / "out", tmp_path / "start", n_epochs=2)
    reference_starts: list[str] = []

    def watch(i: int, plan: IterationPlan) -> None:
        del i
        reference_starts.extend(s.sequence_id for s in plan.training.sequence_starts if s.reference)

    events = []
    for i in range(5000):
        if job.state.is_finished:
            break
        plan = IterationPlan(step_id=i)
        job.schedule(plan, 16, 16)
        watch(i, plan)
        events.extend(job.update(plan, engine.step(plan)))
    assert job.state == JobState.SUCCEEDED and kv.num_free_blocks == kv.num_blocks
    assert len(reference_starts) == 2 * len(PAIRS)  # one pass per side of each pair, in epoch 1 only
    state = read_trainer_state(tmp_path / "out" / "ckpt-step-2")
    assert sorted(state.reference_logprobs) == [0, 1, 2, 3]
    saved = json.loads((tmp_path / "out" / "ckpt-step-2" / "trainer_state.json").read_text())
    assert len(saved["reference_logprobs"]) == 4


def test_dropping_kv_mid_pair_gives_the_same_weights(llama_dir: Path, tmp_path: Path) -> None:
    engine = _engine(llama_dir)
    kv = KVBlockManager(48, 8, enable_prefix_caching=False)
    _start_checkpoint(engine, tmp_path / "start")
    whole = _dpo_job(engine, kv, tmp_path / "a", tmp_path / "start", job_id="whole")
    _drive(engine, whole, kv, SCHEDULES["uniform16"], steps=2)
    expected = _weights(engine, "whole")
    dropping = _dpo_job(engine, kv, tmp_path / "b", tmp_path / "start", job_id="dropping")
    drops = []

    def interrupt(i: int, plan: IterationPlan) -> None:
        if i % 5 == 2:
            drops.append(dropping.release_kv(plan))

    _drive(engine, dropping, kv, SCHEDULES["uniform16"], steps=2, before=interrupt)
    assert sum(1 for d in drops if d) >= 3, "the test must drop sequences mid-pair"
    got = _weights(engine, "dropping")
    assert max(rel_errs(got, expected).values()) <= MAX_REL_ERR  # a dropped pair recomputes in another order
