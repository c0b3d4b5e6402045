"""Models on vLLM's engine: one vLLM cannot load (its error, not coserve's traceback), and SmolLM2-135M-
Instruct in float32, where vLLM's engine and coserve's give the same greedy replies, with and without a
JSON schema, and sampled replies under the schema parse into the pydantic model; with the default
`dtype="auto"` both engines serve SmolLM2 in float32 (its config's dtype) and agree token for token.

A module of its own: vLLM keeps process-wide state (its parallel groups), so two vLLM engines in one
process must not overlap in time; test_vllm_engine's engine is gone when these start.
"""

from __future__ import annotations

import gc
import logging
import shutil
from pathlib import Path

import pytest
from pydantic import BaseModel

from vllm_support import TEST_KV_GB, require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from coserve import LLM, SamplingParams, StructuredOutput  # noqa: E402
from coserve.vllm.backend import VllmLoadError  # noqa: E402

SIZES = {"dtype": "float32", "max_num_seqs": 8, "max_batch_tokens": 48}


def test_model_vllm_cannot_load_reports_vllms_error(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "no-weights"
    shutil.copytree(llama_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(VllmLoadError, match="vLLM could not load the model") as info:
        LLM(model=str(broken), engine="vllm", kv_cache_memory_gb=TEST_KV_GB, **SIZES)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # vLLM's reason, not a chain


class City(BaseModel):
    name: str
    country: str
    population_millions: float
    is_capital: bool


@pytest.mark.real_model
def test_smollm2_greedy_parity_and_structured_output(smollm2_dir: Path) -> None:
    chats = [[{"role": "user", "content": q}] for q in
             ("What is the capital of France?", "Give me three tips for staying healthy.",
              "Write a haiku about the sea.")]
    cities = [[{"role": "user", "content": f"Describe the city of {c} as JSON."}] for c in ("Tokyo", "Paris")]
    # As the official client's `parse` sends it: no properties besides the model's.
    spec = StructuredOutput.json_schema({**City.model_json_schema(), "additionalProperties": False})
    params = SamplingParams(temperature=0, max_tokens=32)
    structured = SamplingParams(temperature=0, max_tokens=120, structured_output=spec)
    sampled = SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=120, structured_output=spec)
    sizes = {"dtype": "float32", "max_num_seqs": 4, "max_batch_tokens": 256, "max_model_len": 2048}
    native = LLM(model=str(smollm2_dir), **sizes)
    ours = [o.outputs[0].token_ids for o in native.chat(chats, params) + native.chat(cities, structured)]
    vllm_llm = LLM(model=str(smollm2_dir), engine="vllm", kv_cache_memory_gb=TEST_KV_GB, **sizes)
    greedy = vllm_llm.chat(cities, structured)
    theirs = [o.outputs[0].token_ids for o in vllm_llm.chat(chats, params) + greedy]
    assert theirs == ours
    replies = [c for o in greedy + vllm_llm.chat(cities, sampled) for c in o.outputs]
    assert len(replies) == 8
    for reply in replies:
        assert reply.finish_reason == "stop", reply.text
        City.model_validate_json(reply.text)
    assert City.model_validate_json(greedy[1].outputs[0].text).name == "Paris"  # the model answers, in the schema


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_default_dtype_is_the_same_on_both_engines(smollm2_dir: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """No dtype argument: "auto" is SmolLM2's float32 on both engines (vLLM's own "auto" would serve it
    in bfloat16 on CPU, and 2 of these 4 greedy replies diverged), so the replies are the same tokens, and
    vLLM casts no weight (no per-tensor warning, no summary line)."""
    chats = [[{"role": "user", "content": q}] for q in
             ("What is the capital of France?", "Give me three tips for staying healthy.",
              "Write a haiku about the sea.", "Explain what a prime number is in one sentence.")]
    params = SamplingParams(temperature=0, max_tokens=32)
    sizes = {"max_num_seqs": 4, "max_batch_tokens": 256, "max_model_len": 2048}
    native = LLM(model=str(smollm2_dir), **sizes)
    assert (native.engine.layout.engine, native.engine.layout.dtype) == ("torch", "float32")
    ours = [o.outputs[0].token_ids for o in native.chat(chats, params)]
    del native
    with caplog.at_level(logging.DEBUG, logger="coserve.vllm.cast_warnings"):
        vllm_llm = LLM(model=str(smollm2_dir), engine="vllm", kv_cache_memory_gb=TEST_KV_GB, **sizes)
    try:
        assert (vllm_llm.engine.layout.engine, vllm_llm.engine.layout.dtype) == ("vllm", "float32")
        assert not [r for r in caplog.records if r.name == "coserve.vllm.cast_warnings"]
        theirs = [o.outputs[0].token_ids for o in vllm_llm.chat(chats, params)]
    finally:
        del vllm_llm  # one vLLM engine at a time in this process (module docstring)
        gc.collect()
    assert theirs == ours
