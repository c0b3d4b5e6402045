"""A reinforcement job's step inside the engine's fused forward, driven by `CoservedJob` plans, against
peft + the policy-gradient loss written plainly + AdamW (fp32, CPU).

The job's batch is fed (`FedBatches.feed`): graded rollouts of its prompts, each a prompt and a
completion with the sampler's log-prob of every completion token and GRPO's group advantage. The trainer
trains the completion tokens with `importance_sampling` (-exp(l - q) A per token) or `ppo` (the clipped
ratio), the batch's mean over its completion tokens, beside a decoding request under uneven budgets.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_coserved_training import LORA, OPTIMIZER, SCHEDULES, _drive, _engine, _start_checkpoint, _weights
from transformers import AutoModelForCausalLM

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.plan import IterationPlan
from coserve.contract.training_plan import TrainingExample
from coserve.finetune.job import CoservedJob
from coserve.finetune.rollout_batches import FedBatch, Rollout, fed_batches, group_advantages
from coserve.finetune.rollouts import needs_rollouts
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from train_reference import MAX_REL_ERR, check_weights, rel_errs

PROMPTS = (6, 9, 5)  # prompt lengths; two rollouts each
COMPLETIONS = ((7, 4), (5, 9), (8, 3))
REWARDS = ((1.0, 0.0), (0.2, 0.9), (0.5, 0.5))  # the last group is constant: advantage 0


def _rollouts(vocab: int) -> tuple[list[TrainingExample], list[Rollout]]:
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(8, vocab, (n,), generator=g).tolist() for n in PROMPTS]
    rollouts = []
    for index, (lengths, rewards) in enumerate(zip(COMPLETIONS, REWARDS)):
        for length, reward in zip(lengths, rewards):
            completion = torch.randint(8, vocab, (length,), generator=g).tolist()
            # the sampler's log-probs: an older policy's. The tiny random model gives a random token about
            # log(1 / vocab); +-0.5 around it puts the ratios in ~[0.6, 1.6]: PPO clips some, not all
            sampled = (math.log(1.0 / vocab) + torch.rand(length, generator=g) - 0.5).tolist()
            rollouts.append(Rollout(index, prompts[index], completion, sampled, reward))
    return [TrainingExample(p, [False] * len(p)) for p in prompts], rollouts


def _reference(model_dir: Path, init: dict[str, torch.Tensor], rollouts: list[Rollout], advantages: list[float],
               loss: LossSpec) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float, int]:
    """Weights after the step, its gradient, its loss and how many tokens PPO's clip froze."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(hf, LoraConfig(r=LORA.r, lora_alpha=LORA.lora_alpha, lora_dropout=0.0,
                                          target_modules=list(LORA.target_modules)))
    params = {n.replace(".default.weight", ".weight"): p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(init[name])
    total, count, clipped = torch.zeros(()), sum(len(r.completion_token_ids) for r in rollouts), 0
    for rollout, advantage in zip(rollouts, advantages):
        ids = torch.tensor(rollout.prompt_token_ids + rollout.completion_token_ids)
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
        picked = torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None]).squeeze(1)
        logprobs = picked[len(rollout.prompt_token_ids) - 1:]  # the completion tokens'
        ratio = torch.exp(logprobs - torch.tensor(rollout.sampling_logprobs))
        if loss.kind == LossKind.IMPORTANCE_SAMPLING:
            terms = -ratio * advantage
        else:
            bounded = ratio.clamp(loss.clip_low, loss.clip_high) * advantage
            terms = -torch.minimum(ratio * advantage, bounded)
            clipped += int(((ratio * advantage) > bounded).sum())
        total = total + terms.sum()
    mean = total / count
    mean.backward()
    grads = {name: p.grad.clone() for name, p in params.items()}
    torch.nn.utils.clip_grad_norm_(params.values(), OPTIMIZER.max_grad_norm)
    adamw = torch.optim.AdamW(params.values(), lr=OPTIMIZER.learning_rate, betas=OPTIMIZER.betas,
                              eps=OPTIMIZER.eps, weight_decay=OPTIMIZER.weight_decay)
    adamw.step()
    return {name: p.detach().clone() for name, p in params.items()}, grads, float(mean.detach()), clipped


@pytest.mark.parametrize(("kind", "schedule"), [(LossKind.IMPORTANCE_SAMPLING, "uneven"),
                                                 (LossKind.PPO, "one_window"), (LossKind.PPO, "uneven")])
def test_a_fed_rollout_batch_trains_the_policy_gradient_exactly(llama_dir: Path, tmp_path: Path,
                                                                 kind: LossKind, schedule: str) -> None:
    engine = _engine(llama_dir)
    kv = KVBlockManager(48, 8, enable_prefix_caching=False)
    init = _start_checkpoint(engine, tmp_path / "start")
    prompts, rollouts = _rollouts(engine.model_config.vocab_size)
    loss = LossSpec(kind)
    spec = FinetuneJobSpec(job_id="rl", tenant="t", adapter_id=100, examples=prompts, n_epochs=1,
                           batch_size=len(prompts), seed=11, num_layers=engine.model_config.num_layers,
                           output_dir=str(tmp_path / "out"), optimizer=OPTIMIZER, min_tasklet_tokens=1,
                           resume_from=str(tmp_path / "start"), start_position=DataPosition(seed=11), loss=loss)
    job = CoservedJob(spec, kv, AdapterSlots(2))
    _, after = DataPosition(seed=11).next_batch(len(prompts), len(prompts))
    advantages = [a for k in range(0, len(rollouts), 2)
                  for a in group_advantages([r.reward for r in rollouts[k:k + 2]])]
    assert advantages[4:] == [0.0, 0.0] and advantages[0] == pytest.approx(1.0)
    fed_batches(job.source).feed(FedBatch(after, rollouts, advantages, {"train_reward_mean": 0.5}))
    events = _drive(engine, job, kv, SCHEDULES[schedule], steps=1, with_inference=True)
    weights, grads, reference_loss, clipped = _reference(llama_dir, init, rollouts, advantages, loss)
    if kind == LossKind.PPO:
        assert 0 < clipped < sum(len(r.completion_token_ids) for r in rollouts[:4])  # some, not all
    (step,) = [e for e in events if e.kind.value == "step"]
    # a mean of ratio x advantage terms of both signs; each ratio exp(lp - s) moves by the relative error of
    # its log-prob, ~TERM_ULPS u |lp| <= 1e-5 for |lp| < 40, summed over a few dozen tokens: 1e-4 relative
    assert step.loss == pytest.approx(reference_loss, rel=1e-4, abs=1e-7)
    assert step.num_tokens == sum(len(r.completion_token_ids) for r in rollouts)
    assert step.metrics["train_reward_mean"] == 0.5
    noisy = {k: g.abs() < 1e-4 * g.abs().max() for k, g in grads.items()}
    check_weights(_weights(engine, "rl"), weights, noisy, bound=6 * OPTIMIZER.learning_rate)
    # it did move: one Adam step is ~lr per element; weight decay alone would move 1e-6 of a tensor
    assert max(rel_errs(init, weights).values()) > 5 * MAX_REL_ERR
    assert not needs_rollouts(job)  # the epoch (one batch) is done: the job finishes, no more sampling


def test_a_reinforcement_job_waits_for_its_rollouts(llama_dir: Path, tmp_path: Path) -> None:
    engine = _engine(llama_dir)
    kv = KVBlockManager(48, 8, enable_prefix_caching=False)
    prompts, _ = _rollouts(engine.model_config.vocab_size)
    spec = FinetuneJobSpec(job_id="rl", tenant="t", adapter_id=100, examples=prompts, n_epochs=1, batch_size=3,
                           seed=11, num_layers=engine.model_config.num_layers, output_dir=str(tmp_path),
                           lora=LORA, loss=LossSpec(LossKind.IMPORTANCE_SAMPLING))
    job = CoservedJob(spec, kv, AdapterSlots(2))
    plan = IterationPlan(step_id=0)
    assert job.schedule(plan, 64, 64) == 0.0 and plan.training.job_starts  # started, nothing to train
    job.update(plan, engine.step(plan))
    assert job.state.value == "running" and needs_rollouts(job)
    assert job.schedule(IterationPlan(step_id=1), 64, 64) == 0.0  # no batch fed: no work
