"""Models on vLLM's engine: one vLLM cannot load (its error, not coserve's traceback), and SmolLM2-135M-
Instruct in float32, where vLLM's engine and coserve's give the same greedy replies.

A module of its own: vLLM keeps process-wide state (its parallel groups), so two vLLM engines in one
process must not overlap in time; test_vllm_engine's engine is gone when these start.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm_support import TEST_KV_GB, require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from coserve import LLM, SamplingParams  # noqa: E402
from coserve.platform.vllm_backend import VllmLoadError  # noqa: E402

SIZES = {"dtype": "float32", "max_num_seqs": 8, "max_batch_tokens": 48}


def test_model_vllm_cannot_load_reports_vllms_error(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "no-weights"
    shutil.copytree(llama_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(VllmLoadError, match="vLLM could not load the model") as info:
        LLM(model=str(broken), engine="vllm", kv_cache_memory_gb=TEST_KV_GB, **SIZES)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # vLLM's reason, not a chain


@pytest.mark.real_model
def test_smollm2_greedy_parity(smollm2_dir: Path) -> None:
    chats = [[{"role": "user", "content": q}] for q in
             ("What is the capital of France?", "Give me three tips for staying healthy.",
              "Write a haiku about the sea.")]
    params = SamplingParams(temperature=0, max_tokens=32)
    sizes = {"dtype": "float32", "max_num_seqs": 4, "max_batch_tokens": 256, "max_model_len": 2048}
    ours = [o.outputs[0].token_ids for o in LLM(model=str(smollm2_dir), **sizes).chat(chats, params)]
    vllm_llm = LLM(model=str(smollm2_dir), engine="vllm", kv_cache_memory_gb=TEST_KV_GB, **sizes)
    theirs = [o.outputs[0].token_ids for o in vllm_llm.chat(chats, params)]
    assert theirs == ours
