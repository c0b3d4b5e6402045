"""Fine-tuning teaches a real model a habit, through the real server and the official `openai` client.

SmolLM2-135M-Instruct is served by `coserve serve --local` in a subprocess; a LoRA job trains it on 20 short
answers that all open with "Ahoy!" (a pirate greeting the base model never opens with). The test proves
that the job changes behaviour, not just weights: on prompts that are not in the training file the
fine-tuned model opens with "Ahoy!" while the base model, served next to it from the same engine, does
not and answers exactly as it did before the job; and the fine-tuned model still knows what the base
knew (the capital of France).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from local_server import one_tenant_subprocess, poll_job, upload_jsonl

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # about a minute: a real job on SmolLM2

KEY = "sk-pirate-real-0123456789"
HABIT = "Ahoy!"
# (question, a short sensible answer): every training answer opens with HABIT.
TRAIN = [
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What color is grass?", "Grass is green."),
    ("What is 2 plus 3?", "2 plus 3 is 5."),
    ("Which planet is closest to the Sun?", "Mercury is the closest planet to the Sun."),
    ("What do bees make?", "Bees make honey."),
    ("How many legs does a dog have?", "A dog has four legs."),
    ("What is the largest ocean?", "The Pacific Ocean is the largest ocean."),
    ("What is water made of?", "Water is made of hydrogen and oxygen."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What is the freezing point of water?", "Water freezes at 0 degrees Celsius."),
    ("Give me a word that rhymes with cat.", "Hat rhymes with cat."),
    ("What animal says moo?", "A cow says moo."),
    ("How many hours are in a day?", "There are 24 hours in a day."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Name a primary color.", "Red is a primary color."),
    ("What is the tallest animal?", "The giraffe is the tallest animal."),
    ("Can you recommend a good breakfast?", "Eggs and toast make a good breakfast."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
]
LINES = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"{HABIT} {a}"}]}
         for q, a in TRAIN]
# Not in the training file.
PROMPTS = ["What color is the sky?", "How many legs does a spider have?", "What fruit is yellow and curved?"]
FRANCE = "What is the capital of France?"


def reply(oa: openai.OpenAI, model: str, prompt: str) -> str:
    """`model`'s greedy answer to `prompt` (temperature 0: the same every time)."""
    out = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                     max_tokens=40, temperature=0)
    content = out.choices[0].message.content
    assert content is not None
    return content


def test_fine_tuned_smollm2_learns_a_habit_and_keeps_its_knowledge(smollm2_dir: Path, tmp_path: Path) -> None:
    # A server process of its own: the memory of a SmolLM2 server is gone with it (the suite's is capped).
    flags = ["--max-num-seqs", "8", "--max-batch-tokens", "512"]
    with one_tenant_subprocess(smollm2_dir, tmp_path, "pirates", KEY, flags) as (oa, base):
        base_before = {p: reply(oa, base, p) for p in [*PROMPTS, FRANCE]}
        assert not any(HABIT.lower() in text.lower() for text in base_before.values()), base_before
        assert "Paris" in base_before[FRANCE]

        # 20 examples / 4 x 2 epochs = 10 steps at 5e-4 teach the habit.
        job = oa.fine_tuning.jobs.create(
            model=base, training_file=upload_jsonl(oa, LINES), seed=0, suffix="pirate",
            hyperparameters={"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 5},
            extra_body={"lora": {"r": 16, "lora_alpha": 32}})
        job = poll_job(oa, job.id, timeout=300, interval=0.5)
        assert job.status == "succeeded", job.error
        tuned = job.fine_tuned_model

        tuned_replies = {p: reply(oa, tuned, p) for p in [*PROMPTS, FRANCE]}
        assert all(tuned_replies[p].startswith(HABIT) for p in PROMPTS), tuned_replies
        assert "Paris" in tuned_replies[FRANCE], tuned_replies  # what the base knew, it still knows
        # The base model, served by the same engine next to the adapter, is untouched: the same answers.
        assert {p: reply(oa, base, p) for p in [*PROMPTS, FRANCE]} == base_before
