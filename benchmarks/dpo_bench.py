"""DPO alone: coserve's DPO job against TRL's `DPOTrainer` with a peft LoRA, side by side in one run.

usage (from the repository root; TRL is a benchmark reference only: `.venv/bin/pip install trl`)::

    .venv/bin/python benchmarks/dpo_bench.py --model ~/.cache/coserve/models/smollm2-135m-instruct \\
        --pairs 16 --batch 4 --rounds 2 --json benchmarks/out/dpo_bench.json

Both arms train the same preference pairs (chat-templated prompt, a short preferred answer and a long
non-preferred one), the same LoRA (r 16, alpha 32, all seven projections, fp32), AdamW at 1e-4 with
clipping at 1.0, beta 0.1, the same batch of pairs, two epochs; both take the reference by switching
the adapter off (TRL does so for a peft model given no reference). Each arm runs in a fresh subprocess,
the arms alternating over `--rounds`.

- **coserve**: the offline `LLM` (the same scheduler policy, EngineCore and engine as the server), its
  DPO job stepped to the end. Pairs/s per epoch: epoch 1 pays each pair's reference pass, epoch 2 reuses
  the stored sums, so the reference pass's share of a step is 1 - t(epoch 2) / t(epoch 1).
- **trl**: `DPOTrainer.train()` with a callback timing each epoch.

Activation memory, one rule for both (`coserve/bench/trainer_arms.py`'s `SavedMeter`): the peak of the
bytes the trainer keeps between pieces (coserve: its sequences' `kept_bytes()`) plus the live tensors
autograd saves for backward, base weights and LoRA parameters excluded. It is also given per trained
token of what is in flight at the peak (coserve: the pair being trained; TRL: the whole batch, which it
forwards in one graph), and, for coserve, against the same job trained with cross-entropy on the
preferred answers (`--sft`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
LORA = {"r": 16, "lora_alpha": 32}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BETA, EPOCHS = 0.1, 2
LONG = ("Well, that is an interesting question, and there are many things one could say about it, so let "
        "me take a moment to think it through carefully before answering, because {fact} is the short "
        "version, but the long version has a great deal more to it than that.")


def pairs(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        fact = f"{i} plus {i} is {2 * i}"
        rows.append({"input": {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}]},
                     "preferred_output": [{"role": "assistant", "content": f"{fact.capitalize()}."}],
                     "non_preferred_output": [{"role": "assistant", "content": LONG.format(fact=fact)}]})
    return rows


def _epoch_times(step_times: list[float], steps_per_epoch: int, start: float) -> list[float]:
    ends = [step_times[(e + 1) * steps_per_epoch - 1] for e in range(EPOCHS)]
    return [ends[0] - start, ends[1] - ends[0]]


def coserve_arm(args: argparse.Namespace) -> dict[str, Any]:
    from coserve import LLM
    from coserve.bench.trainer_arms import SavedMeter, _storage, _tensors
    from coserve.contract.loss_spec import LossKind, LossSpec
    from coserve.trainer.windowed import WindowedTrainer

    torch.set_num_threads(args.threads)
    llm = LLM(model=str(args.model), dtype="float32", max_lora_rank=LORA["r"])
    rows = pairs(args.pairs)
    examples = rows if not args.sft else [
        {"messages": [*r["input"]["messages"], *r["preferred_output"]]} for r in rows]
    loss = None if args.sft else LossSpec(LossKind.DPO, beta=BETA)
    runtime = llm.engine.training

    def kept() -> tuple[int, set[int]]:
        states = [s.state for s in runtime.sequences.values()]
        buffers = [t for s in states for t in (*s.layer_inputs, *s.keys, *s.values, *s.key_grads,
                                                *s.value_grads, s.grad_hidden) if t is not None]
        return sum(s.kept_bytes() for s in states), {_storage(t)[0] for t in buffers}

    meter = SavedMeter(list(_tensors(llm.engine.model.weights)), kept)
    tasklet = WindowedTrainer.backward_tasklet
    held = {"kept": 0, "tokens": 0}  # the tokens in flight when the kept bytes peak

    def sample() -> None:
        meter.sample()
        if meter.kept_peak > held["kept"]:
            held["kept"] = meter.kept_peak
            held["tokens"] = sum(s.state.length for s in runtime.sequences.values())

    def metered_tasklet(self: WindowedTrainer, *a: Any, **kw: Any) -> tuple[int, int]:
        meter.new_graph()  # each tasklet is a graph of its own, freed by its backward
        sample()
        out = tasklet(self, *a, **kw)
        sample()
        return out

    WindowedTrainer.backward_tasklet = metered_tasklet  # type: ignore[method-assign]  # this process only
    job_id = llm.start_fine_tune(examples, tempfile.mkdtemp(), seed=0, loss=loss, lora=LORA,
                                 hyperparameters={"n_epochs": EPOCHS, "batch_size": args.batch})
    job = llm.jobs.job(job_id)
    steps_per_epoch = -(-args.pairs // args.batch)
    step_times: list[float] = []
    start = time.perf_counter()
    with meter.hooks():
        while not job.state.is_finished:
            meter.new_graph()
            llm.step()
            sample()
            while len(step_times) < job.position.step:
                step_times.append(time.perf_counter())
    result = llm.jobs.result(job_id)
    epochs = _epoch_times(step_times, steps_per_epoch, start)
    return {"epoch_s": epochs, "pairs_per_s": [args.pairs / t for t in epochs],
            "reference_share": 1 - epochs[1] / epochs[0], "peak_bytes": meter.peak,
            "kept_peak_bytes": meter.kept_peak, "tokens_in_flight_at_peak": held["tokens"],
            "losses": result.losses, "trained_tokens": result.trained_tokens}


def trl_arm(args: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from coserve.bench.trainer_arms import SavedMeter

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_list([{"prompt": r["input"]["messages"], "chosen": r["preferred_output"],
                               "rejected": r["non_preferred_output"]} for r in pairs(args.pairs)])
    meter = SavedMeter(list(model.parameters()))
    times: list[float] = []

    class Timing(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            meter.new_graph()

        def on_epoch_end(self, *a: Any, **kw: Any) -> None:
            times.append(time.perf_counter())

    config = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch,
                       learning_rate=1e-4, num_train_epochs=EPOCHS, beta=BETA, weight_decay=0.0,
                       max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
                       logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                       dataloader_num_workers=0, bf16=False,  # fp32, as the coserve arm
                       gradient_checkpointing=not args.trl_no_checkpointing)
    trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["lora_alpha"],
                                                lora_dropout=0.0, target_modules=TARGETS),
                         callbacks=[Timing()])
    start = time.perf_counter()
    with meter.hooks():
        trainer.train()
    epochs = [times[0] - start, times[1] - times[0]]
    # TRL forwards a batch's chosen and rejected sequences in one graph, padded to the longest.
    lengths = [len(tokenizer.apply_chat_template([*r["input"]["messages"], *r[key]], tokenize=True,
                                                 return_dict=False))
               for r in pairs(args.pairs) for key in ("preferred_output", "non_preferred_output")]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"epoch_s": epochs, "pairs_per_s": [args.pairs / t for t in epochs], "peak_bytes": meter.peak,
            "tokens_in_flight_at_peak": 2 * args.batch * max(lengths), "losses": losses}


def run_arm(arm: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--arm", arm, "--model", str(args.model), "--pairs", str(args.pairs),
           "--batch", str(args.batch), "--threads", str(args.threads), *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arm", choices=["coserve", "trl"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sft", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trl-no-checkpointing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.arm is not None:
        print(json.dumps((trl_arm if args.arm == "trl" else coserve_arm)(args)))
        return 0
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    # TRL's defaults checkpoint gradients (recompute, less memory); "trl_full" keeps every activation.
    arms = {"coserve": ("coserve", []), "trl": ("trl", []), "trl_full": ("trl", ["--trl-no-checkpointing"])}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*arms, "coserve_sft"]}
    for k in range(args.rounds):
        order = list(arms) if k % 2 == 0 else list(reversed(arms))
        for name in order:
            runs[name].append(run_arm(arms[name][0], args, arms[name][1]))
            print(name, runs[name][-1]["pairs_per_s"], runs[name][-1]["peak_bytes"], flush=True)
    runs["coserve_sft"].append(run_arm("coserve", args, ["--sft"]))

    def med(arm: str, key: str, epoch: int) -> float:
        return statistics.median(r[key][epoch] for r in runs[arm])

    summary = {
        "pairs_per_s_epoch1": {a: med(a, "pairs_per_s", 0) for a in arms},
        "pairs_per_s_epoch2": {a: med(a, "pairs_per_s", 1) for a in arms},
        "speed_ratio_epoch2": {a: med("coserve", "pairs_per_s", 1) / med(a, "pairs_per_s", 1)
                               for a in ("trl", "trl_full")},
        "speed_ratio_epoch1": {a: med("coserve", "pairs_per_s", 0) / med(a, "pairs_per_s", 0)
                               for a in ("trl", "trl_full")},
        "reference_share": statistics.median(r["reference_share"] for r in runs["coserve"]),
        "peak_bytes": {a: statistics.median(r["peak_bytes"] for r in runs[a]) for a in runs},
    }
    summary["memory_ratio"] = {a: summary["peak_bytes"]["coserve"] / summary["peak_bytes"][a]
                               for a in ("trl", "trl_full")}
    summary["peak_bytes_per_token_in_flight"] = {
        a: statistics.median(r["peak_bytes"] / r["tokens_in_flight_at_peak"] for r in runs[a]) for a in runs}
    result = {"summary": summary, "runs": runs,
              "meta": {"started": started, "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                       "command": " ".join(sys.argv)}}
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
