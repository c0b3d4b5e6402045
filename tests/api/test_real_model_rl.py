"""Reinforcement fine-tuning raises a real model's reward on held-out prompts, through the real server and
the official `openai` client.

SmolLM2-135M-Instruct is served by `coserve serve --local --enable-python-graders` in a subprocess. The task
is single-digit addition with a short answer (the benchmark `benchmarks/rl_smollm2.py` runs the same task
offline): a python grader gives 1 for the right number alone, 0.5 for the right number inside text, 0
otherwise. A `method: reinforcement` job trains on 40 prompts (2 epochs, batches of 8, 4 samples each)
and evaluates 16 held-out prompts (the validation file, 4 samples each) at step 0, with the base's weights,
and after its last step. The tuned reward must beat the base's by a clear margin; the tuned model serves
at once under its `ft:` id.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from local_server import one_tenant_subprocess, poll_job, upload_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rl_smollm2 import GRADER, rows  # noqa: E402 - the benchmark's task, so both measure one thing

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # about five minutes: 10 RL steps on SmolLM2

KEY = "sk-rl-real-0123456789"


def test_reinforcement_raises_smollm2s_held_out_reward(smollm2_dir: Path, tmp_path: Path) -> None:
    train, held = rows()
    flags = ["--max-num-seqs", "32", "--max-batch-tokens", "512", "--enable-python-graders"]
    with one_tenant_subprocess(smollm2_dir, tmp_path, "rl", KEY, flags) as (oa, base):
        job = oa.fine_tuning.jobs.create(
            model=base, training_file=upload_jsonl(oa, train), validation_file=upload_jsonl(oa, held), seed=0,
            suffix="adder", extra_body={"lora": {"r": 16, "lora_alpha": 32}},
            method={"type": "reinforcement", "reinforcement": {  # type: ignore[typeddict-item]
                "grader": GRADER, "max_completion_tokens": 16,
                "hyperparameters": {"n_epochs": 2, "batch_size": 8, "learning_rate_multiplier": 2,
                                    "compute_multiplier": 1, "eval_interval": 10, "eval_samples": 4}}})
        job = poll_job(oa, job.id, timeout=900, interval=1.0)
        assert job.status == "succeeded", job.error
        metrics = [e.data for e in oa.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"]
        valid = {d["step"]: d["valid_reward_mean"] for d in metrics if "valid_reward_mean" in d}
        assert sorted(valid) == [0, 10], valid
        assert valid[10] >= valid[0] + 0.15, valid  # measured 2026-11-28: 0.109 -> 0.445
        steps = sorted((d for d in metrics if "train_reward_mean" in d), key=lambda d: d["step"])
        assert len(steps) == 10 and all(d["train_grade_errors"] == 0 for d in steps)
        reply = oa.chat.completions.create(model=job.fine_tuned_model or "", max_tokens=8, temperature=0,
                                           messages=[{"role": "user",
                                                      "content": "What is 3 + 4? Reply with only the number."}])
        assert reply.choices[0].message.content
