"""`coserve profile`: fit the iteration latency model on this machine (registered by `coserve.cli`).

    coserve profile --model DIR [--device D] [--dtype T] [--iterations N] [--repeats R] [--threads T] --json OUT

Writes `{"heldout_mape", "heldout_samples", "coefficients", ...}`: the fitted `LatencyModel` (its
`to_dict`, which `serve` loads) plus how well it predicted the held-out iterations. Heavy imports
(torch, peft) happen inside the handler so that `coserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from coserve.contract.engine import EngineKind


def register_profile(subparsers: Any) -> None:
    """Add `coserve profile` to the `coserve` parser."""
    parser = subparsers.add_parser(
        "profile", help="measure engine iterations and fit the latency model (JSON out)",
        description="A designed sweep of real engine iterations (decodes, prefill chunks, adapters, "
                    "fine-tuning windows and tasklets); fits the latency model on part of them and "
                    "reports its error on the rest.")
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--json", required=True, help="write the fitted profile here")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--iterations", type=int, default=160, help="measured iterations (default: 160)")
    parser.add_argument("--adapters", type=int, default=2, help="LoRA adapters in the sweep (default: 2)")
    parser.add_argument("--max-context", type=int, default=512,
                        help="longest decode context in the sweep (default: 512)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per scenario, the fastest kept (default: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads while profiling (default: torch's); profile with the threads "
                             "the engine will serve with, since an iteration's time depends on them")
    parser.add_argument("--engine", type=EngineKind.parse, default=EngineKind.TORCH,
                        metavar="{" + ",".join(k.value for k in EngineKind) + "}",
                        help="the backend to profile, as `coserve serve --engine` (default: torch)")
    parser.set_defaults(handler=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from coserve.backends.registry import build_engine
    from coserve.bench.profiler import SweepSettings, profile, typed_engine
    from coserve.contract.engine import EngineStartError
    from coserve.contract.engine_config import EngineConfig
    from coserve.model.tiny_model import create_random_adapter
    from coserve.planner.latency import ModelFingerprint, engine_machine_id, model_id_from_config

    if (args.adapters < 0 or args.iterations < 4 or args.max_context < 16 or args.repeats < 1
            or (args.threads is not None and args.threads < 1)):
        print("error: --adapters must be >= 0, --iterations >= 4, --max-context >= 16, --repeats >= 1, "
              "--threads >= 1", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    contexts = tuple(c for c in (16, 128, 512, 2048) if c <= args.max_context)
    settings = SweepSettings(iterations=args.iterations, seed=args.seed, contexts=contexts,
                             repeats=args.repeats)
    # Room for every decode at the longest context, the longest prefill and the training sequence.
    tokens = max(settings.decodes) * (max(contexts) + 1) + 512 + settings.finetune_length + 1024
    try:
        engine = build_engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                           num_kv_blocks=tokens // 16 + 1, block_size=16,
                                           max_loras=args.adapters + 1, max_lora_rank=16, seed=args.seed,
                                           engine=args.engine, max_batch_tokens=2048))
    except EngineStartError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    config = json.loads((Path(args.model) / "config.json").read_text(encoding="utf-8"))
    fingerprint = ModelFingerprint(model_id_from_config(config), engine_machine_id(args.device, args.engine),
                                   str(typed_engine(engine).dtype).removeprefix("torch."))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [str(create_random_adapter(args.model, Path(tmp) / f"a{i}", seed=i, r=8,
                                              lora_alpha=16, target_modules=["q_proj", "v_proj"]))
                    for i in range(args.adapters)]
        report = profile(engine, fingerprint, adapters, settings)
    Path(args.json).write_text(json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n",
                               encoding="utf-8")
    print(f"held-out MAPE {report.heldout_mape:.2f}% on {report.heldout_samples} iterations "
          f"(fit on {report.train_samples}, fit MAPE {report.train_mape:.2f}%) with {torch.get_num_threads()} "
          f"torch thread(s); wrote {args.json}")
    return 0
