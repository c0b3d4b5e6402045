"""Does a dedicated Ray Train run train what the co-served trainer trains? The same job both ways.

The job (chat examples, seed, hyperparameters, LoRA settings) is prepared once with `prepare_job`, then
trained by `LLM.fine_tune` (one process, the co-served trainer in the engine's iterations) and by a
`DedicatedRun` (a Ray Train TorchTrainer of `--workers` CPU workers, gloo). Prints the largest relative
difference of the per-step losses and of the validation losses, the largest absolute difference of the
final adapter's weights (and the largest weight), and each side's wall time (on a shared machine only
the agreement numbers mean much).

usage: python benchmarks/dedicated_agreement.py [--model DIR] [--epochs 3] [--batch-size 4] [--examples 14]
                                               [--workers 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file


def _examples(count: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: a tiny random llama, made here)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--examples", type=int, default=14)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    import ray
    from transformers import AutoTokenizer

    from coserve import LLM
    from coserve.contract.dedicated_run import RunSpec
    from coserve.contract.job_spec import JobEventKind
    from coserve.contract.training_settings import HyperparameterRequest, LoRASettings
    from coserve.dedicated.run import launch
    from coserve.jobs.prepared_job import prepare_job
    from coserve.model.config import ModelConfig

    root = Path(tempfile.mkdtemp(prefix="dedicated-agreement-"))
    model = args.model
    if model is None:
        from coserve.model.tiny_model import create_tiny_model

        model = str(create_tiny_model(root / "tiny", arch="llama", preset="tiny", seed=7))
    examples, validation = _examples(args.examples), _examples(args.examples + 2)[-2:]
    hp = {"n_epochs": args.epochs, "batch_size": args.batch_size}
    started = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, max_model_len=512, max_lora_rank=8)
    ref = llm.fine_tune(examples, str(root / "coserved"), hp, {"r": 4}, seed=3, validation=validation)
    coserved_s = time.perf_counter() - started

    prepared = prepare_job(AutoTokenizer.from_pretrained(model), examples, job_id="ftjob-agreement", tenant="t",
                           adapter_id=1, num_layers=ModelConfig.from_pretrained(model).num_layers, max_len=512,
                           output_dir=root / "dedicated", seed=3, hyperparameters=HyperparameterRequest(**hp),
                           lora=LoRASettings(r=4), base_model_name_or_path=model, validation=validation)
    ray.init(address="local", num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter()
    handle = launch(RunSpec(prepared.spec, model, args.dtype, str(root / "dedicated"), "run-1", args.workers))
    events = []
    while True:
        update, _ = ray.get(handle.poll.remote())
        events += update.events
        if update.done:
            break
        time.sleep(0.2)
    dedicated_s = time.perf_counter() - started
    ray.shutdown()

    def of(kind: JobEventKind) -> list:
        return [e for e in events if e.kind == kind]

    (done,) = of(JobEventKind.SUCCEEDED)
    losses = [e.loss for e in of(JobEventKind.STEP)]
    valid = [e.loss for e in of(JobEventKind.VALIDATION)]
    assert len(losses) == len(ref.losses) and len(valid) == len(ref.validation_losses)
    mine = load_file(f"{done.path}/adapter_model.safetensors")
    theirs = load_file(f"{ref.adapter_path}/adapter_model.safetensors")
    weight_diff = max(float((mine[k] - t).abs().max()) for k, t in theirs.items())
    print(f"machine: {platform.node()} ({platform.machine()}), model {Path(model).name}, {args.dtype}, "
          f"{len(losses)} steps, {args.workers} workers")
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses))
    valid_gap = max(abs(a - b) / abs(b) for a, b in zip(valid, ref.validation_losses))
    print(f"loss:            max relative difference {loss_gap:.2e}")
    print(f"validation loss: max relative difference {valid_gap:.2e}")
    print(f"adapter weights: max absolute difference {weight_diff:.2e} "
          f"(largest weight {max(float(t.abs().max()) for t in theirs.values()):.3f})")
    print(f"wall: co-served (LLM.fine_tune, model load included) {coserved_s:.1f} s, "
          f"dedicated (Ray Train, worker start included) {dedicated_s:.1f} s")


if __name__ == "__main__":
    main()
