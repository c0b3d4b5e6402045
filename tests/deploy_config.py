"""deploy/'s Serve configs with this machine's paths: what the deploy and Ray tests run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


SERVE_CONFIGS = ("serve.yaml", "serve-multi-gpu.yaml")  # an existing (KubeRay) cluster; one node, 8 GPUs


def serve_config(name: str = "serve.yaml") -> dict[str, Any]:
    """deploy/<name>, parsed."""
    return yaml.safe_load((DEPLOY / name).read_text())


# What the configs set for their GPUs that `local_args` leaves out on the CPU (refused there: CUDA only).
GPU_ONLY_ARGS = ("gpu_memory_utilization",)


def local_args(args: dict[str, Any], model: Path, tenants: Path, data_dir: Path, engines: int = 1) -> dict[str, Any]:
    """The config's arguments with this machine's model, tenants file and data dir, on the CPU, with
    `engines` engines (one CPU each) instead of the config's GPUs (and without its GPU-only arguments)."""
    kept = {name: value for name, value in args.items() if name not in GPU_ONLY_ARGS}
    return {**kept, "model": str(model), "tenants": str(tenants), "data_dir": str(data_dir), "device": "cpu",
            "dtype": "float32", "engines": engines}
