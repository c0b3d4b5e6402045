"""`coserve bench ...`: the benchmarks shipped with coserve (registered by `coserve.cli`).

Heavy imports (torch, transformers, peft) happen inside the handlers so that `coserve --help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any


def _trainer(parser: argparse.ArgumentParser) -> Any:
    def handler(args: argparse.Namespace) -> int:
        from coserve.bench import trainer

        return trainer.main(trainer.resolve_args(parser, args))
    return handler


def _coserving(args: argparse.Namespace) -> int:
    from coserve.bench.coserving import run_coserving_benchmark

    return run_coserving_benchmark(args)


def _cluster_validate(args: argparse.Namespace) -> int:
    from coserve.bench.cluster_validate import run_validate_command

    return run_validate_command(args)


def _cluster_project(args: argparse.Namespace) -> int:
    from coserve.bench.cluster_projection import run_project_command

    return run_project_command(args)


def _gpu_projection(args: argparse.Namespace) -> int:
    from coserve.bench.gpu_projection import run_command

    return run_command(args)


def _register_cluster(bench_sub: Any) -> None:
    """`coserve bench cluster validate|project` (issue 19): several engines under one scheduler."""
    cluster = bench_sub.add_parser(
        "cluster", help="several engines under one scheduler: measured runs vs the simulator, projections",
        description="validate: 1- and 2-engine runs measured here against the cluster simulator. project: N "
                    "simulated engines x 1000 tenants, and where the central scheduler becomes the bottleneck.")
    sub = cluster.add_subparsers(dest="cluster_command", metavar="MODE")
    sub.required = True
    from coserve.bench.cluster_projection import add_arguments as add_project_arguments  # no torch at import
    from coserve.bench.cluster_validate import add_arguments as add_validate_arguments

    validate = sub.add_parser("validate", help="measured 1- and 2-engine runs vs the cluster simulator")
    add_validate_arguments(validate)
    validate.set_defaults(handler=_cluster_validate)
    project = sub.add_parser("project", help="N engines x 1000 tenants in the cluster simulator")
    add_project_arguments(project)
    project.set_defaults(handler=_cluster_project)


def register_bench(subparsers: Any) -> None:
    """Add `coserve bench trainer`, `coserve bench co-serving`, `coserve bench cluster` and `coserve bench
    gpu-projection` to the `coserve` parser."""
    bench = subparsers.add_parser("bench", help="run a benchmark and write its results as JSON")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench_sub.required = True
    trainer = bench_sub.add_parser(
        "trainer", help="the windowed LoRA trainer vs transformers + peft (memory and speed)",
        description="Training alone on the small preset, 512-token sequences, batch 1: activation bytes "
                    "per token and tokens/s of coserve's trainer against transformers + peft.")
    from coserve.bench.trainer import add_arguments  # argparse only: no torch at import

    add_arguments(trainer)
    trainer.set_defaults(handler=_trainer(trainer))

    coserving = bench_sub.add_parser(
        "co-serving", help="inference arrivals + one fine-tuning job, per policy and rate (JSON, plots)",
        description="Replay Poisson and bursty inference arrivals at several rates while a fine-tuning "
                    "job runs, once per policy (coserve's hybrid token policy, temporal sharing, "
                    "dynamic temporal sharing, static split), on the small preset.")
    from coserve.bench.coserving import add_arguments as add_coserving_arguments  # no torch at import

    add_coserving_arguments(coserving)
    coserving.set_defaults(handler=_coserving)
    _register_cluster(bench_sub)
    projection = bench_sub.add_parser(
        "gpu-projection", help="the co-serving policies on a simulated A100/H100 (published figures, no GPU)",
        description="Project the co-serving benchmark to Llama-3.2-1B and Llama-3.1-8B on one A100-80GB or "
                    "H100-80GB: the simulator with a roofline iteration model built from published figures.")
    from coserve.bench.gpu_projection import add_arguments as add_projection_arguments  # no torch at import

    add_projection_arguments(projection)
    projection.set_defaults(handler=_gpu_projection)
