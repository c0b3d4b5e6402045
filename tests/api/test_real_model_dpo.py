"""DPO teaches a real model a preference that carries to unseen prompts, through the real server and the
official `openai` client.

SmolLM2-135M-Instruct is served by `coserve serve --local` in a subprocess. The base model first answers
12 questions itself (greedy, up to 32 tokens: it elaborates, as it usually does). A `method: dpo` job then
trains on 8 of them (each row twice: 16 rows, one epoch, 4 steps): the preferred answer is one short
sentence, the non-preferred one the base's own elaboration (self-generated rejections: what the model
would do). Its reference model is the base with the adapter off, in the same engine. The test proves the
preference is learnt, not just the pairs:
- on the 4 held-out pairs (the validation file) the reward accuracy after training is high; before the
  first step every reward is 0 (the adapter starts as the base), so it starts at 0;
- on prompts in neither file, the tuned model's greedy answers are much shorter than the base's;
- the base model, served next to it from the same engine, answers exactly as before.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from test_real_model_finetune import TRAIN

from local_server import one_tenant_subprocess, poll_job, upload_jsonl

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # about a minute: a real job on SmolLM2

KEY = "sk-dpo-real-0123456789"
FACTS = TRAIN[:12]  # the pirate test's questions with plain answers: 8 pairs to train on, 4 held out
CUT = " [...]"  # marks an answer that hit max_tokens
# In neither file.
PROMPTS = ["What color is a banana?", "How many legs does a spider have?", "What is the capital of Germany?",
           "What do cats like to eat?"]


def _pair(question: str, fact: str, elaboration: str) -> dict:
    return {"input": {"messages": [{"role": "user", "content": question}]},
            "preferred_output": [{"role": "assistant", "content": fact}],
            "non_preferred_output": [{"role": "assistant", "content": elaboration}]}


def reply(oa: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> str:
    """The greedy answer, with CUT appended when it ran out of tokens rather than ending."""
    out = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                     max_tokens=max_tokens, temperature=0)
    content = out.choices[0].message.content
    assert content is not None
    return content if out.choices[0].finish_reason == "stop" else content + CUT


def replies(oa: openai.OpenAI, model: str, prompts: list[str], max_tokens: int = 48) -> dict[str, str]:
    """`model`'s greedy answers, asked at once (the server batches them)."""
    with ThreadPoolExecutor(8) as pool:
        return dict(zip(prompts, pool.map(lambda p: reply(oa, model, p, max_tokens), prompts), strict=True))


def test_dpo_teaches_smollm2_to_answer_briefly(smollm2_dir: Path, tmp_path: Path) -> None:
    # A server process of its own: the memory of a SmolLM2 server is gone with it (the suite's is capped).
    flags = ["--max-num-seqs", "8", "--max-batch-tokens", "512"]
    with one_tenant_subprocess(smollm2_dir, tmp_path, "brief", KEY, flags) as (oa, base):
        base_before = replies(oa, base, PROMPTS)
        elaborations = replies(oa, base, [q for q, _ in FACTS], max_tokens=32)
        pairs = [_pair(q, f, elaborations[q].removesuffix(CUT)) for q, f in FACTS]
        pairs = [p for p in pairs if p["preferred_output"] != p["non_preferred_output"]]
        job = oa.fine_tuning.jobs.create(
            model=base, training_file=upload_jsonl(oa, pairs[:8] * 2),
            validation_file=upload_jsonl(oa, pairs[8:12]), seed=0, suffix="brief",
            method={"type": "dpo", "dpo": {"hyperparameters": {  # type: ignore[typeddict-item]
                "beta": 0.1, "n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 2}}})
        job = poll_job(oa, job.id, timeout=600, interval=0.5)
        assert job.status == "succeeded", job.error
        events = [e.data for e in oa.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"]
        validation = [d for d in reversed(events) if "valid_rewards/accuracies" in d]
        assert len(validation) == 1  # one per epoch
        assert validation[-1]["valid_rewards/accuracies"] >= 5 / 6, validation
        assert validation[-1]["valid_rewards/margins"] > 0, validation

        tuned = replies(oa, job.fine_tuned_model, PROMPTS)  # type: ignore[arg-type]
        words = {name: sum(len(text.split()) for text in replies.values())
                 for name, replies in (("base", base_before), ("tuned", tuned))}
        assert words["tuned"] <= 0.6 * words["base"], (base_before, tuned)
        ended = {name: sum(not text.endswith(CUT) for text in answers.values())
                 for name, answers in (("base", base_before), ("tuned", tuned))}
        assert ended["tuned"] > ended["base"], (base_before, tuned)  # it stops on its own more often
        assert replies(oa, base, PROMPTS) == base_before  # the base is untouched
