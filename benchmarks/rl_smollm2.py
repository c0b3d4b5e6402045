"""Reinforcement fine-tuning (GRPO, offline `LLM.start_reinforcement`) teaches SmolLM2-135M-Instruct
single-digit addition with short answers. Held-out reward and accuracy before and after, side by side.

usage (from the repository root)::

    .venv/bin/python benchmarks/rl_smollm2.py --model ~/.cache/coserve/models/smollm2-135m-instruct \\
        --json benchmarks/out/rl_smollm2.json

The task: "What is a + b? Reply with only the number." for a, b in 1..9; 40 training prompts, 16 held out
(no pair in both). The reward (a python grader): 1.0 for the right number and nothing else, 0.5 for the
right number inside other text (its last number), 0 otherwise. `--epochs` of batches of 8 prompts, 4
samples each (temperature 1, at most 16 tokens), importance-sampling loss, LoRA r 16 / alpha 32.
Held-out: the mean reward of 4 samples per prompt (temperature 1, seeded), and the greedy answers'
accuracy (their last number).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from coserve import LLM, SamplingParams
from coserve.contract.grader import parse_grader
from coserve.graders.grading import grade
from coserve.graders.python_grader import PythonGraderRunner
from coserve.offline.lora_request import LoRARequest

GRADER = {"type": "python", "name": "addition", "source": (
    "import re\n"
    "def grade(sample, item):\n"
    "    text = sample['output_text'].strip()\n"
    "    numbers = re.findall(r'-?\\d+', text)\n"
    "    if not numbers or numbers[-1] != item['answer']:\n"
    "        return 0.0\n"
    "    return 1.0 if re.fullmatch(r'-?\\d+\\.?', text) else 0.5\n")}


def rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(0).shuffle(pairs)

    def row(a: int, b: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
                "answer": str(a + b)}

    return [row(*p) for p in pairs[:40]], [row(*p) for p in pairs[60:76]]


def evaluate(llm: LLM, held: list[dict[str, Any]], lora: LoRARequest | None) -> dict[str, Any]:
    grader, runner = parse_grader(GRADER), PythonGraderRunner()
    sampled = llm.chat([r["messages"] for r in held], SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=7),
                       lora_request=lora)
    rewards = [grade(grader, r, o.text, runner).reward for r, out in zip(held, sampled) for o in out.outputs]
    greedy = [out.outputs[0].text for out in llm.chat([r["messages"] for r in held],
                                                      SamplingParams(temperature=0.0, max_tokens=16),
                                                      lora_request=lora)]
    right = [bool(n := re.findall(r"-?\d+", t)) and n[-1] == r["answer"] for t, r in zip(greedy, held)]
    return {"reward_mean": sum(rewards) / len(rewards), "greedy_accuracy": sum(right) / len(right),
            "greedy_answers": greedy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--lr-multiplier", type=float, default=10.0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    train, held = rows()
    llm = LLM(str(args.model), dtype="float32", max_lora_rank=16, max_batch_tokens=512, max_num_seqs=32)
    before = evaluate(llm, held, None)
    start = time.perf_counter()
    hyperparameters = {"n_epochs": args.epochs, "batch_size": 8, "learning_rate_multiplier": args.lr_multiplier}
    job_id = llm.start_reinforcement(train, GRADER, tempfile.mkdtemp(), hyperparameters,
                                     {"r": 16, "lora_alpha": 32}, samples=4, max_tokens=16)
    result = llm.wait(job_id)
    seconds = time.perf_counter() - start
    steps = [{"step": e.step, "loss": e.loss, "trained_tokens": e.num_tokens, **e.metrics}
             for e in result.events if e.kind.value == "step"]
    after = evaluate(llm, held, LoRARequest("tuned", 1, str(result.adapter_path)))
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(args.model),
              "state": result.state.value, "train_seconds": seconds, "steps": steps, "before": before,
              "after": after, "lr_multiplier": args.lr_multiplier, "epochs": args.epochs}
    for step in steps:
        print(f"step {step['step']}: train reward {step['train_reward_mean']:.3f}, "
              f"{step['trained_tokens']} completion tokens")
    print(f"held-out reward {before['reward_mean']:.3f} -> {after['reward_mean']:.3f}; greedy accuracy "
          f"{before['greedy_accuracy']:.2f} -> {after['greedy_accuracy']:.2f}; {seconds:.0f} s of training")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
