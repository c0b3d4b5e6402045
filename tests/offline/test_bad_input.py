"""Bad input gets a clear exception saying why, never a crash deep inside an iteration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from coserve import LLM, LoRARequest, SamplingParams
from coserve.model.adapter_files import AdapterError
from coserve.model.config import UnsupportedModelError


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=64, max_lora_rank=4,
               num_kv_blocks=32)


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_names_the_supported_ones(llama_dir: Path, tmp_path: Path) -> None:
    model = _copy_model(llama_dir, tmp_path / "gpt2")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3"):
        LLM(model=str(model))


def test_unsupported_rope_type(llama_dir: Path, tmp_path: Path) -> None:
    model = _copy_model(llama_dir, tmp_path / "yarn")
    config = json.loads((model / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn'"):
        LLM(model=str(model))


def test_missing_weight_files(llama_dir: Path, tmp_path: Path) -> None:
    model = _copy_model(llama_dir, tmp_path / "noweights")
    for f in model.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(UnsupportedModelError, match="missing weight files"):
        LLM(model=str(model))


def test_not_a_model_folder(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        LLM(model=str(tmp_path))


def _adapter(llama_dir: Path, out: Path, **lora: object) -> Path:
    get_peft_model(AutoModelForCausalLM.from_pretrained(llama_dir), LoraConfig(**lora)).save_pretrained(out)
    return out


def test_adapter_with_unsupported_target_module(llm: LLM, llama_dir: Path, tmp_path: Path) -> None:
    path = _adapter(llama_dir, tmp_path / "lmhead", r=2, target_modules=["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match="lm_head"):
        llm.generate("hello", lora_request=LoRARequest("x", 1, str(path)))


def test_adapter_rank_above_slot_maximum(llm: LLM, llama_dir: Path, tmp_path: Path) -> None:
    path = _adapter(llama_dir, tmp_path / "r8", r=8, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="rank 8.*max_lora_rank 4"):
        llm.generate("hello", lora_request=LoRARequest("x", 2, str(path)))


def test_adapter_folder_without_config(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="adapter_config.json"):
        llm.generate("hello", lora_request=LoRARequest("x", 3, str(tmp_path)))


def test_prompt_longer_than_context(llm: LLM) -> None:
    with pytest.raises(ValueError, match="65 tokens.*max_model_len=64"):
        llm.generate({"prompt_token_ids": [10] * 65})
    # The engine is still usable afterwards.
    out = llm.generate({"prompt_token_ids": [10] * 8}, SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("kwargs, param", [({"temperature": -1}, "temperature"),
                                           ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                                           ({"top_k": -5}, "top_k"), ({"n": 0}, "n")])
def test_bad_sampling_params(kwargs: dict, param: str) -> None:
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


def test_mismatched_list_lengths(llm: LLM) -> None:
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], lora_request=[None])
