"""One meaning for `--dtype`: "auto" is the model config's dtype for both engines (a float32 model stays
float32 on the CPU, where vLLM's own "auto" would make it bfloat16), vLLM gets the explicit name, the
engines' layouts say what serves, and vLLM's per-tensor cast warnings become one summary line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from coserve.contract.engine import EngineKind
from coserve.contract.engine_config import EngineConfig
from coserve.model.config import ModelConfig, dtype_name, resolve_dtype
from coserve.server.options import ServeOptions
from coserve.vllm.cast_warnings import CAST_LOGGERS, CAST_MESSAGE, summarized_cast_warnings


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    """A copy of the model folder `src` whose config.json has `changes` (None: the key removed)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("changes", "auto"), [
    ({"dtype": "float32", "torch_dtype": None}, "float32"),  # transformers 5.x spelling
    ({"dtype": None, "torch_dtype": "bfloat16"}, "bfloat16"),  # transformers 4.x spelling
    ({"dtype": "float16", "torch_dtype": None}, "float16"),
    ({"dtype": None, "torch_dtype": None}, "float32"),  # a config naming none: float32
])
def test_auto_is_the_model_configs_dtype_and_explicit_ones_are_kept(
        llama_dir: Path, tmp_path: Path, changes: dict[str, object], auto: str) -> None:
    model = _with_config(llama_dir, tmp_path / "model", **changes)
    config = ModelConfig.from_pretrained(model)
    assert dtype_name("auto", config) == auto
    assert resolve_dtype("auto", config) == getattr(torch, auto)
    for asked, name in (("float32", "float32"), ("fp32", "float32"), ("bf16", "bfloat16"),
                        ("bfloat16", "bfloat16"), ("half", "float16")):
        assert dtype_name(asked, config) == name
    with pytest.raises(ValueError, match="unsupported dtype"):
        dtype_name("float8", config)
    # The server resolves it the same way whichever engine serves (the Ray banner's dtype).
    for engine in EngineKind:
        opts = ServeOptions(model=str(model), tenants="unused.yaml", engine=engine)
        assert opts.resolved_dtype() == auto


def test_the_native_engine_layout_says_what_serves(llama_dir: Path, tmp_path: Path) -> None:
    from coserve.torch_engine.engine import TorchEngine

    sizes = {"num_kv_blocks": 8, "max_loras": 1}
    engine = TorchEngine(EngineConfig(model=str(llama_dir), **sizes))  # dtype "auto": the config's float32
    assert (engine.layout.engine, engine.layout.dtype, engine.dtype) == ("torch", "float32", torch.float32)
    bf16 = _with_config(llama_dir, tmp_path / "bf16", dtype="bfloat16")
    engine = TorchEngine(EngineConfig(model=str(bf16), **sizes))
    assert (engine.layout.dtype, engine.dtype) == ("bfloat16", torch.bfloat16)
    engine = TorchEngine(EngineConfig(model=str(bf16), dtype="float32", **sizes))  # the operator's choice
    assert engine.layout.dtype == "float32"


class _Stop(Exception):
    """Raised by the fake vLLM runtime once it has seen its settings."""


@pytest.mark.parametrize(("asked", "handed"), [("auto", "float32"), ("bf16", "bfloat16"), ("float16", "float16")])
def test_vllm_is_handed_an_explicit_dtype(llama_dir: Path, monkeypatch: pytest.MonkeyPatch, asked: str,
                                          handed: str) -> None:
    """Never vLLM's own "auto" (a float32 model in bfloat16 on the CPU): the name coserve resolved."""
    from coserve.vllm import engine as vllm_engine

    seen = []

    def fake_runtime(settings: object) -> None:
        seen.append(settings)
        raise _Stop

    monkeypatch.setattr(vllm_engine, "VllmRuntime", fake_runtime)
    with pytest.raises(_Stop):
        vllm_engine.VllmEngine(EngineConfig(model=str(llama_dir), dtype=asked, engine=EngineKind.VLLM))
    assert [s.dtype for s in seen] == [handed]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_vllms_per_tensor_cast_warnings_become_one_line(caplog: pytest.LogCaptureFixture) -> None:
    vllm_logger = logging.getLogger(CAST_LOGGERS[0])
    passed = _Records()
    vllm_logger.addHandler(passed)
    try:
        with caplog.at_level(logging.DEBUG, logger="coserve.vllm.cast_warnings"):
            with summarized_cast_warnings() as cast_filter:
                for name in ("embed_tokens.weight", "layers.0.q_proj.weight", "norm.weight"):
                    vllm_logger.warning(CAST_MESSAGE, name, torch.float32, torch.bfloat16)
                logging.getLogger(CAST_LOGGERS[1]).warning(CAST_MESSAGE, "lm_head", torch.float16, torch.bfloat16)
                vllm_logger.warning("Ignoring weight %s", "rotary.inv_freq")  # another line goes through
            vllm_logger.warning(CAST_MESSAGE, "after.weight", torch.float32, torch.bfloat16)  # filter removed
    finally:
        vllm_logger.removeHandler(passed)
    assert [r.getMessage() for r in passed.records] == [
        "Ignoring weight rotary.inv_freq",
        "Attempted to load weight after.weight with dtype torch.float32 into parameter with dtype torch.bfloat16"]
    assert dict(cast_filter.casts) == {("float32", "bfloat16"): 3, ("float16", "bfloat16"): 1}
    summary = [r for r in caplog.records if r.name == "coserve.vllm.cast_warnings"]
    assert [(r.levelno, r.getMessage()) for r in summary] == [
        (logging.WARNING, "vLLM cast 3 weight tensor(s) from float32 to bfloat16 while loading the model"),
        (logging.WARNING, "vLLM cast 1 weight tensor(s) from float16 to bfloat16 while loading the model")]


def test_no_cast_no_summary(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="coserve.vllm.cast_warnings"):
        with summarized_cast_warnings():
            pass
    assert not [r for r in caplog.records if r.name == "coserve.vllm.cast_warnings"]
