"""deploy/serve.yaml's application with this machine's paths: what the deploy and Ray tests run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def serve_config() -> dict[str, Any]:
    """deploy/serve.yaml, parsed."""
    return yaml.safe_load((DEPLOY / "serve.yaml").read_text())


def local_args(args: dict[str, Any], model: Path, tenants: Path, data_dir: Path) -> dict[str, Any]:
    """The config's arguments with this machine's model, tenants file and data dir, on the CPU."""
    return {**args, "model": str(model), "tenants": str(tenants), "data_dir": str(data_dir), "device": "cpu",
            "dtype": "float32"}
