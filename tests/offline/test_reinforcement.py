"""Offline reinforcement fine-tuning (`LLM.start_reinforcement`) on the tiny llama: rollouts are sampled from
the adapter being trained, through its bank slot, with nothing copied or written between steps.

The check: every rollout's recorded sampling log-probs are the log-probs peft gives its tokens with the
weights the job had when it sampled them: the base model's (PEFT's init, B = 0) for step 1's rollouts,
and the step-1 checkpoint's for step 2's, which differ from the base model's. Rewards (a python grader)
reach each step's event."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from coserve import LLM
from coserve.finetune.rollout_batches import FedBatch, fed_batches

ROWS = [{"messages": [{"role": "user", "content": f"Write something about {i}."}], "letter": "e"} for i in range(10)]
# The share of the answer's characters that are the row's letter: varied rewards on a random model's text.
GRADER = {"type": "python", "name": "letters",
          "source": "def grade(sample, item):\n    text = sample['output_text']\n"
                    "    return text.count(item['letter']) / max(1, len(text))\n"}


def _completion_logprobs(model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor(prompt + completion)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None]).squeeze(1)
    return picked[len(prompt) - 1:]


def test_rollouts_sample_from_the_adapter_being_trained(llama_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_lora_rank=8, max_batch_tokens=128)
    job_id = llm.start_reinforcement(ROWS, GRADER, str(tmp_path / "out"), {"n_epochs": 2, "batch_size": 10},
                                     {"r": 4}, seed=5, samples=4, max_tokens=6)
    job = llm.jobs.job(job_id)
    fed: list[FedBatch] = []
    source = fed_batches(job.source)
    feed = source.feed

    def record(batch: FedBatch) -> None:
        fed.append(batch)
        feed(batch)

    source.feed = record  # type: ignore[method-assign]  # this job only
    result = llm.wait(job_id)
    assert result.state.value == "succeeded", result.error
    steps = [e for e in result.events if e.kind.value == "step"]
    assert [e.step for e in steps] == [1, 2] and len(fed) == 2 and all(len(b.rollouts) == 40 for b in fed)
    for event, batch in zip(steps, fed):
        rewards = [r.reward for r in batch.rollouts]
        assert event.metrics["train_reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert event.num_tokens == sum(len(r.completion_token_ids) for r in batch.rollouts)
    assert len({r.reward for r in fed[0].rollouts}) > 1  # the rewards vary: the step has a gradient
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32),
                                      result.checkpoints[0])
    moved = 0.0
    for model, batch in ((base, fed[0]), (tuned, fed[1])):
        for rollout in batch.rollouts:
            expected = _completion_logprobs(model, rollout.prompt_token_ids, rollout.completion_token_ids)
            # a sampled token's log-prob, decode against transformers' full forward: the parity bound
            # (test_parity: 1e-5 of the logits' span, ~10 here) per token
            torch.testing.assert_close(torch.tensor(rollout.sampling_logprobs), expected, rtol=1e-4, atol=1e-4)
    for rollout in fed[1].rollouts:  # step 2 sampled from weights that are not the base model's
        on_base = _completion_logprobs(base, rollout.prompt_token_ids, rollout.completion_token_ids)
        moved = max(moved, float((on_base - torch.tensor(rollout.sampling_logprobs)).abs().max()))
    assert moved > 1e-3
