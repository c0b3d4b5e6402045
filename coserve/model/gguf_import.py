"""Import a GGUF file (llama.cpp's format) into a standard HF-format model folder.

Reading and dequantizing is transformers' GGUF loader (`from_pretrained(..., gguf_file=...)`, built
on the `gguf` library): it undoes llama.cpp's q/k row permutation and rebuilds the tokenizer with its
chat template. This module adds what that loader leaves out, so the folder is right for any reader:

- checks before any work: family, quantization types, a file cut short (the loader's own errors
  are numpy reshape messages);
- config fields the loader drops: `head_dim` from `attention.key_length` (Qwen3), rope scaling
  (`rope.scaling.*` metadata, or Llama 3's per-frequency `rope_freqs` tensor, refitted to the
  `llama3` rule and checked), and the end-of-turn tokens (eot/eom) among the eos ids;
- an atomic write: the folder is built beside the target and renamed into place at the end, so a
  failure leaves no half-written model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# GGUF `general.architecture` -> HF class. llama.cpp stores Mistral models as "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_GGUF_ARCHITECTURES = "llama (Llama, Mistral), qwen2, qwen3"
# Tensor types the `gguf` library dequantizes, as far as these families use them (its ternary and FP4
# types belong to other model families).
SUPPORTED_QUANT_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
OUTPUT_DTYPES = ("float32", "bfloat16", "float16")
# Files every imported folder has; the last one is written last, so it marks a finished import.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "coserve_source.json")

Log = Callable[[str], None]


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported: unreadable, cut short, or of an unsupported kind."""


def log_to_stderr(message: str) -> None:
    """Default progress log: one line on stderr, so that stdout carries only results."""
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GGUFSummary:
    """What `inspect_gguf` learned from a GGUF file's header, before any tensor is read."""

    path: Path
    architecture: str  # GGUF name: llama, qwen2, qwen3
    name: str
    tensor_types: dict[str, int]  # quantization type -> tensor count
    config_overrides: dict[str, Any] = field(default_factory=dict)
    license: str | None = None

    def describe(self) -> str:
        types = ", ".join(f"{count} {kind}" for kind, count in sorted(self.tensor_types.items()))
        return f"{self.name or self.path.name} ({self.architecture}; tensors: {types})"


def is_model_folder(path: str | Path) -> bool:
    """True when `path` holds a finished import (every file of `MODEL_FILES`)."""
    return all((Path(path) / name).is_file() for name in MODEL_FILES)


def _open_reader(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFImportError(f"no such file: {path}")
    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, OSError) as error:
        # GGUFReader reports a short file as a numpy dtype/reshape error: say what it means.
        raise GGUFImportError(f"{path} is not a valid GGUF file or is incomplete (truncated download?): "
                              f"{error}") from error


def _field(reader: Any, key: str, default: Any = None) -> Any:
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def _required(reader: Any, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFImportError(f"the GGUF file has no {key!r} metadata")
    return value


def inspect_gguf(path: str | Path) -> GGUFSummary:
    """Read and check a GGUF header: family, tensor types, file size, config fields to fix.

    Raises:
        GGUFImportError: unreadable or truncated file, unsupported architecture or tensor type.
    """
    path = Path(path)
    reader = _open_reader(path)
    arch = str(_field(reader, "general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFImportError(f"unsupported GGUF architecture {arch!r}; coserve imports "
                              f"{SUPPORTED_GGUF_ARCHITECTURES}")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    unsupported = sorted(set(types) - set(SUPPORTED_QUANT_TYPES))
    if unsupported:
        raise GGUFImportError(f"unsupported tensor type(s) {', '.join(unsupported)} in {path}; "
                              f"supported: {', '.join(SUPPORTED_QUANT_TYPES)}")
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:  # the reader does not always notice a short last tensor
        raise GGUFImportError(f"{path} is truncated: its tensors need {end} bytes, the file has "
                              f"{path.stat().st_size}")
    return GGUFSummary(path=path, architecture=arch, name=str(_field(reader, "general.name", "")),
                       tensor_types=dict(types), config_overrides=_config_overrides(reader, arch),
                       license=_field(reader, "general.license"))


def _config_overrides(reader: Any, arch: str) -> dict[str, Any]:
    """config.json fields that transformers' GGUF loader leaves unset or wrong."""
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    heads = int(_required(reader, f"{arch}.attention.head_count"))
    # llama.cpp's own default when key_length is absent; transformers' Qwen3 default (128) is not.
    head_dim = int(_field(reader, f"{arch}.attention.key_length", 0) or hidden // heads)
    rotary = int(_field(reader, f"{arch}.rope.dimension_count", 0) or head_dim)
    if rotary != head_dim:
        raise GGUFImportError(f"partial rotary embeddings (rope.dimension_count={rotary}, "
                              f"head_dim={head_dim}) are not supported")
    overrides: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]], "head_dim": head_dim,
        "rope_parameters": _rope_parameters(reader, arch, head_dim),
    }
    eos_ids = _eos_ids(reader)
    if eos_ids:
        overrides["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return overrides


def _eos_ids(reader: Any) -> list[int]:
    # llama.cpp stops on eos, eot and eom alike; a Llama 3 chat turn ends with eot (<|eot_id|>).
    ids = [_field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _rope_parameters(reader: Any, arch: str, head_dim: int) -> dict[str, Any]:
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    kind = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta,
                "factor": float(_required(reader, f"{arch}.rope.scaling.factor"))}
    if kind != "none":
        raise GGUFImportError(f"unsupported rope scaling {kind!r}; supported: none, linear, "
                              "llama3 (rope_freqs)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return {"rope_type": "default", "rope_theta": theta}
    return _fit_llama3_rope(freqs.data.astype("float32").tolist(), theta, head_dim)


def _fit_llama3_rope(factors: list[float], theta: float, head_dim: int) -> dict[str, Any]:
    """Llama 3 rope settings that reproduce llama.cpp's per-frequency divisors `factors`.

    llama.cpp keeps only the divisors; HF configs keep the rule's parameters. In the band between
    the two cut-offs the rule is linear in the base frequency, which gives the parameters up to a
    common scale (fixed by low_freq_factor=1); every candidate is checked against the divisors.
    """
    import torch

    from coserve.model.config import RopeConfig
    from coserve.model.rope_frequencies import inverse_frequencies

    base = inverse_frequencies(RopeConfig(theta=theta), head_dim)
    target = torch.tensor(factors, dtype=torch.float32)
    if len(factors) != len(base):
        raise GGUFImportError(f"rope_freqs has {len(factors)} values; head_dim {head_dim} needs {len(base)}")
    if torch.allclose(target, torch.ones_like(target)):
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(target.max())
    band = (target > 1 + 1e-4) & (target < factor - 1e-4)
    candidates = [(1.0, 4.0, 8192)]
    if int(band.sum()) >= 2:
        smooth = (1 / target[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = _line_fit(base[band].double(), smooth.double())
        if intercept < 0:
            # Rounded: configs hold round numbers (4.0, not 4.00000046 from float32 divisors).
            candidates.insert(0, (1.0, round(1.0 - 1.0 / intercept, 4),
                                  round(-2 * math.pi * slope / intercept)))
    for low, high, old_len in candidates:
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                  "high_freq_factor": high, "original_max_position_embeddings": int(old_len)}
        rope = RopeConfig(theta=theta, rope_type="llama3", factor=factor, low_freq_factor=low,
                          high_freq_factor=high, original_max_position_embeddings=int(old_len))
        if torch.allclose(base / inverse_frequencies(rope, head_dim), target, rtol=1e-4, atol=1e-5):
            return params
    raise GGUFImportError("the rope_freqs tensor does not follow Llama 3's rope scaling rule; "
                          "supported rope scaling: none, linear, llama3")


def _line_fit(x: Any, y: Any) -> tuple[float, float]:
    """Least-squares slope and intercept of y = slope * x + intercept."""
    x_mean, y_mean = x.mean(), y.mean()
    slope = ((x - x_mean) * (y - y_mean)).sum() / ((x - x_mean) ** 2).sum()
    return float(slope), float(y_mean - slope * x_mean)


@contextmanager
def atomic_folder(target: Path, replace: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder beside `target`, renamed to `target` when the block succeeds.

    On failure the staging folder is removed and `target` is left as it was. An existing `target`
    is replaced only when `replace` is true (or when it is empty).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    # Beside the target, not in /tmp: a rename is atomic only within one file system.
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield stage
        _apply_umask(stage)
        old = None
        if target.exists() and any(target.iterdir()):
            if not replace:
                raise FileExistsError(f"{target} exists and is not empty")
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
        os.replace(stage, target)  # an empty directory may be replaced in one step
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _apply_umask(folder: Path) -> None:
    # mkdtemp makes the folder private (0700) and some writers make private files: give the result
    # the permissions a plain mkdir/open would have.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def import_gguf(gguf_path: str | Path, target_dir: str | Path, *, dtype: str = "float32",
                force: bool = False, source: dict[str, Any] | None = None, log: Log = log_to_stderr) -> Path:
    """Convert the GGUF file `gguf_path` into the HF-format folder `target_dir`; return its path.

    The folder holds model.safetensors (dequantized to `dtype`), config.json with `architectures`,
    generation_config.json, tokenizer.json and tokenizer_config.json (with the GGUF's chat template),
    and coserve_source.json (where it came from: `source`, plus the GGUF's name and license).

    Raises:
        GGUFImportError: unreadable, truncated or unsupported file, or a bad `dtype`.
        FileExistsError: `target_dir` holds files and `force` is false.
    """
    if dtype not in OUTPUT_DTYPES:
        raise GGUFImportError(f"unsupported dtype {dtype!r}; use one of {', '.join(OUTPUT_DTYPES)}")
    target = Path(target_dir)
    if target.exists() and any(target.iterdir()) and not force:
        raise FileExistsError(f"{target} exists and is not empty; pass --force (force=True) to replace it")
    log(f"reading {gguf_path}")
    summary = inspect_gguf(gguf_path)
    log(f"  {summary.describe()}")
    with atomic_folder(target, replace=force) as stage:
        _write_model(summary, stage, dtype, log)
        _write_tokenizer(summary, stage, log)
        _check_loadable(stage)
        provenance = {**(source or {}), "gguf_file": summary.path.name, "gguf_name": summary.name,
                      "license": summary.license, "tensor_types": summary.tensor_types, "dtype": dtype}
        (stage / "coserve_source.json").write_text(json.dumps(provenance, indent=2) + "\n")
    log(f"wrote {target}")
    return target


def _write_model(summary: GGUFSummary, stage: Path, dtype: str, log: Log) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder, name = str(summary.path.parent), summary.path.name
    log("  reading config")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for key, value in summary.config_overrides.items():
        setattr(config, key, value)
    log(f"  dequantizing {sum(summary.tensor_types.values())} tensors to {dtype}")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config,
                                                 dtype=getattr(torch, dtype))
    # The loader marks the model as "GGUF-quantized" although its weights are plain dequantized
    # tensors; the marker only blocks save_pretrained and would put a bogus quantization_config in
    # config.json, so drop it.
    model.hf_quantizer = None
    for holder in (model.config, config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None))
    log("  writing model.safetensors")
    model.save_pretrained(stage)


def _write_tokenizer(summary: GGUFSummary, stage: Path, log: Log) -> None:
    from transformers import AutoTokenizer

    log("  converting tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(summary.path.parent), gguf_file=summary.path.name)
    # The converter leaves model_max_length at "unlimited"; the model's context is the real limit.
    config = json.loads((stage / "config.json").read_text())
    tokenizer.model_max_length = int(config.get("max_position_embeddings") or tokenizer.model_max_length)
    # The chat template goes in tokenizer_config.json (not chat_template.jinja) so that older
    # transformers and other servers find it too.
    tokenizer.save_pretrained(stage, save_jinja_files=False)


def _check_loadable(stage: Path) -> None:
    """Check the folder's config and weight shapes the way coserve reads them, before it is moved in place."""
    from coserve.model.config import ModelConfig
    from coserve.model.weights import check_weights

    check_weights(stage, ModelConfig.from_pretrained(stage))
