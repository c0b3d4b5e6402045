"""The machine the check runs on: offline settings, what the bare image lacks, and the report's header.

The GPU image has torch, transformers, peft, safetensors, numpy and tokenizers; the two other packages
the checked code imports (llguidance: the engine's grammar masks; simpleeval: the graders, imported by
the co-serving benchmark) come as wheels (`benchmarks/gpu_wheels.sh`, installed by `gpu_check.sh`).
Should llguidance's compiled wheel not load there (its glibc), a stand-in module that raises on any use
takes its place, and the report says so: no part uses structured output, and the engine imports it only
for that.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "peft", "safetensors", "numpy", "tokenizers", "llguidance", "simpleeval")


def offline() -> None:
    """No hub, no telemetry, no tokenizer threads fighting the engine's, no progress bars (set before
    transformers loads)."""
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                       ("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
        os.environ.setdefault(key, value)
    from transformers.utils import logging

    logging.disable_progress_bar()


class _Missing(types.ModuleType):
    """llguidance's stand-in: every attribute is missing (AttributeError, as `hasattr` expects)."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"llguidance.{name}: llguidance is not installed here ({self.reason}); the GPU "
                             "check uses no grammar")

    def __init__(self, reason: str) -> None:
        super().__init__("llguidance")
        self.reason = reason


def ensure_llguidance() -> str:
    """'llguidance <version>', or why a stand-in was put in its place."""
    try:
        import llguidance  # noqa: F401
    except ImportError as err:
        sys.modules["llguidance"] = _Missing(str(err))
        return f"missing ({err}): a stand-in that raises on use was installed"
    return f"llguidance {_version('llguidance')}"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_name(device: str) -> str:
    import torch

    if torch.device(device).type == "cuda":
        return str(torch.cuda.get_device_name(torch.device(device)))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def meta(device: str, root: Path, argv: list[str], llguidance: str) -> dict[str, Any]:
    """The report's header: device, versions, command, date."""
    import torch

    cuda = torch.device(device).type == "cuda"
    return {"device": device, "device_name": _device_name(device),
            "device_memory_gib": torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30
            if cuda else None,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": {"python": platform.python_version(), "libc": " ".join(platform.libc_ver()),
                         "cuda": torch.version.cuda,
                         **{name: _version(name) for name in PACKAGES}},
            "llguidance": llguidance, "commit": _commit(root), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "loadavg_1m_start": os.getloadavg()[0],
            "command": " ".join(argv)}
