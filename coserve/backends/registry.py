"""The engine registry: `EngineKind` -> the builder of that backend (`build_engine(config)`).

It sits above both backends, so neither engine imports the other; each builder imports its backend when
called, so choosing coserve's engine never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from coserve.contract.engine import Engine, EngineKind
from coserve.contract.engine_config import EngineConfig
from coserve.model.config import ModelConfig


class BuiltEngine(Engine, Protocol):
    """What every backend `build_engine` builds offers beyond `Engine`: its settings and the model's config."""

    config: EngineConfig
    model_config: ModelConfig


def _torch(config: EngineConfig) -> BuiltEngine:
    from coserve.torch_engine.engine import TorchEngine

    return TorchEngine(config)


def _vllm(config: EngineConfig) -> BuiltEngine:
    from coserve.vllm.engine import VllmEngine

    return VllmEngine(config)


ENGINE_BUILDERS: dict[EngineKind, Callable[[EngineConfig], BuiltEngine]] = {
    EngineKind.TORCH: _torch,
    EngineKind.VLLM: _vllm,
}


def build_engine(config: EngineConfig) -> BuiltEngine:
    """Build the backend `config.engine` names.

    Raises:
        VllmUnavailable / VllmLoadError (`coserve.vllm.backend`): the vLLM engine without the
            supported vLLM, or a model vLLM cannot load.
        UnsupportedModelError, OSError: the model folder (either backend).
    """
    return ENGINE_BUILDERS[config.engine](config)
