"""Tests of `coserve model create-tiny`: tokenizer, configs per family, peaked weights, CLI."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from coserve import cli
from coserve.model import tiny_model
from coserve.model.chat_templates import CHATML_TEMPLATE, QWEN_TOOLS_TEMPLATE
from coserve.model.tiny_model import ARCHS, count_parameters, create_tiny_model
from coserve.model.tokenizer_train import CHAT_TEMPLATE, SPECIAL_TOKENS, _trained_tokenizer_json, train_tokenizer

PROMPTS = ["Hello, how are you?", "The capital of France is", "def main():", "Once upon a time"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One default tiny model per family, shared by the tests of this module."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: create_tiny_model(root / arch, arch=arch) for arch in ARCHS}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _tensor_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_loads_with_transformers_and_gives_finite_logits(models: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(models[arch])
    assert model.config.model_type == arch
    assert model.dtype == torch.float32
    ids = torch.tensor([[5, 17, 300, 42, 1000]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    with safe_open(str(models[arch] / "model.safetensors"), framework="pt") as handle:
        assert all(handle.get_tensor(name).dtype == torch.float32 for name in handle.keys())


def test_llama_config_has_llama3_rope_in_both_spellings(models: dict[str, Path]) -> None:
    config = _config(models["llama"])
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    assert config["rope_scaling"] == scaling  # pre-5.0 spelling (transformers 4.x, vLLM)
    assert config["rope_theta"] == 10000.0
    assert config["rope_parameters"] == {**scaling, "rope_theta": 10000.0}  # transformers 5.x spelling
    assert AutoConfig.from_pretrained(models["llama"]).rope_parameters == {**scaling, "rope_theta": 10000.0}
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False
    assert "lm_head.weight" in _tensor_names(models["llama"])


def test_family_specifics(models: dict[str, Path]) -> None:
    qwen2, qwen3, mistral = (_config(models[arch]) for arch in ("qwen2", "qwen3", "mistral"))
    qwen2_names = _tensor_names(models["qwen2"])
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias"} <= qwen2_names
    assert qwen2["tie_word_embeddings"] is True and "lm_head.weight" not in qwen2_names
    assert qwen3["head_dim"] == 32 and qwen3["tie_word_embeddings"] is True
    assert "model.layers.0.self_attn.q_norm.weight" in _tensor_names(models["qwen3"])
    assert mistral["sliding_window"] is None and mistral["tie_word_embeddings"] is False
    for arch in ("qwen2", "qwen3", "mistral"):
        config = _config(models[arch])
        assert config["rope_scaling"] is None and config["rope_parameters"]["rope_type"] == "default"
    for arch in ARCHS:
        config = _config(models[arch])
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        assert head_dim >= 32
        assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (128, 2, 2048)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_eos_is_im_end_everywhere(models: dict[str, Path], arch: str) -> None:
    path = models[arch]
    tokenizer = AutoTokenizer.from_pretrained(path)
    generation = json.loads((path / "generation_config.json").read_text())
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == _config(path)["eos_token_id"] == generation["eos_token_id"]
    assert tokenizer.pad_token_id == _config(path)["pad_token_id"] != tokenizer.eos_token_id
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == list(SPECIAL_TOKENS)


def test_tokenizer_round_trip_and_chat_template(models: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(models["llama"])
    assert len(tokenizer) == 2048
    for text in ["Hello, world! How are you today?", "def f(x):\n    return x  +  1\n", "naïve café 日本 🙂"]:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert tokenizer.eos_token_id not in ids and tokenizer.bos_token_id not in ids
    # BPE learned English: common words are single tokens.
    assert len(tokenizer("The library stays open until nine in the evening")["input_ids"]) <= 12
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("Hi!<|im_end|>\n")
    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tokenizer.eos_token_id) == 2  # each turn ends with <|im_end|>, the eos token
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nHi!<|im_end|>\n"
    config = json.loads((models["llama"] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["model_max_length"] == 2048
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_qwen_tiny_models_render_tools_and_match_chatml_without(models: dict[str, Path]) -> None:
    """qwen2/qwen3 get Qwen's tool format (fine-tuning with tools needs it); llama/mistral keep ChatML,
    and every arch renders a conversation without tools to the same text."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}]
    texts = {arch: AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False)
             for arch, path in models.items()}
    assert len(set(texts.values())) == 1
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]}
    for arch in ("qwen2", "qwen3"):
        tokenizer = AutoTokenizer.from_pretrained(models[arch])
        assert tokenizer.chat_template == QWEN_TOOLS_TEMPLATE
        text = tokenizer.apply_chat_template([*messages[:2], call, {"role": "tool", "tool_call_id": "c1",
                                                                    "content": "found"}], tools=tools,
                                             tokenize=False, add_generation_prompt=True)
        assert text == (
            "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with "
            "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:"
            "\n<tools>\n" + json.dumps(tools[0]) + "\n</tools>\n\nFor each function call, return a json "
            "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>"
            '\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
            '{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\n<tool_response>\nfound\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert AutoTokenizer.from_pretrained(models["mistral"]).chat_template == CHAT_TEMPLATE == CHATML_TEMPLATE


def test_tokenizer_training_is_cached_and_deterministic() -> None:
    first = train_tokenizer(2048)
    hits = _trained_tokenizer_json.cache_info().hits
    assert train_tokenizer(2048).to_str() == first.to_str()
    assert _trained_tokenizer_json.cache_info().hits == hits + 1
    assert _trained_tokenizer_json.__wrapped__(2048) == first.to_str()  # retraining gives the same merges


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_are_peaked_and_greedy_text_varies(models: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(models[arch])
    tokenizer = AutoTokenizer.from_pretrained(models[arch])
    gaps: list[float] = []
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None)
        top2 = torch.stack(out.logits)[:, 0].topk(2, dim=-1).values
        gaps += (top2[:, 0] - top2[:, 1]).tolist()
        new_tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        assert len(set(new_tokens)) >= 8, f"degenerate greedy text: {tokenizer.decode(new_tokens)!r}"
    assert statistics.median(gaps) > 2.5
    # EOS stays reachable: its output row is drawn like every other row.
    rows = model.get_output_embeddings().weight.norm(dim=-1)
    assert 0.5 < rows[tokenizer.eos_token_id] / rows.mean() < 2.0


def test_greedy_agrees_between_attention_implementations(models: dict[str, Path]) -> None:
    eager = AutoModelForCausalLM.from_pretrained(models["qwen2"], attn_implementation="eager")
    sdpa = AutoModelForCausalLM.from_pretrained(models["qwen2"], attn_implementation="sdpa")
    inputs = AutoTokenizer.from_pretrained(models["qwen2"])(PROMPTS[1], return_tensors="pt")
    no_cache = eager.generate(**inputs, max_new_tokens=32, do_sample=False, use_cache=False, eos_token_id=None)
    cached = sdpa.generate(**inputs, max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert no_cache.tolist() == cached.tolist()


def test_same_seed_same_weights_and_rng_untouched(tmp_path: Path) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = create_tiny_model(tmp_path / "a", arch="mistral", seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = create_tiny_model(tmp_path / "b", arch="mistral", seed=7)
    c = create_tiny_model(tmp_path / "c", arch="mistral", seed=8)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_overrides(tmp_path: Path) -> None:
    path = create_tiny_model(tmp_path / "q3", arch="qwen3", head_dim=48, num_key_value_heads=1,
                             num_hidden_layers=3, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert (config.head_dim, config.num_key_value_heads, config.num_hidden_layers) == (48, 1, 3)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 48, 128)
    assert not config.tie_word_embeddings and "lm_head.weight" in _tensor_names(path)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()

    llama = create_tiny_model(tmp_path / "llama", attention_bias=True, tie_word_embeddings=True,
                              rope_scaling=None, rope_theta=500000.0)
    config = _config(llama)
    assert config["attention_bias"] is True and config["rope_scaling"] is None
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    names = _tensor_names(llama)
    assert "model.layers.0.self_attn.o_proj.bias" in names and "lm_head.weight" not in names


@pytest.mark.parametrize("bad", [{"num_key_value_head": 1}, {"head_dim": 16}, {"num_key_value_heads": 3}])
def test_bad_overrides_are_rejected(tmp_path: Path, bad: dict) -> None:
    with pytest.raises(ValueError):
        create_tiny_model(tmp_path / "bad", arch="llama", **bad)


def test_small_preset_parameter_count(tmp_path: Path) -> None:
    untied = count_parameters(create_tiny_model(tmp_path / "llama", arch="llama", preset="small"))
    tied = count_parameters(create_tiny_model(tmp_path / "qwen2", arch="qwen2", preset="small"))
    assert 20e6 <= tied < untied <= 32e6
    config = AutoConfig.from_pretrained(tmp_path / "llama")
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim, config.vocab_size) == (512, 8, 64, 8192)
    assert config.rope_parameters["original_max_position_embeddings"] == 512
    assert len(AutoTokenizer.from_pretrained(tmp_path / "llama")) == 8192


def test_cli_create_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "model"
    argv = ["model", "create-tiny", str(target), "--arch", "qwen2", "--seed", "3", "--set", "num_hidden_layers=3"]
    assert cli.main(argv) == 0
    assert "qwen2/tiny" in capsys.readouterr().out
    config = _config(target)
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 3
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "model.safetensors",
            "generation_config.json"} <= {p.name for p in target.iterdir()}
    assert cli.main(argv) == 1  # refuses to overwrite a model
    assert cli.main([*argv, "--force"]) == 0
    assert cli.main(["model", "create-tiny", str(tmp_path / "x"), "--set", "no_such_field=1"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["model", "create-tiny", str(tmp_path / "y"), "--arch", "gpt2"])


def test_cli_choices_match_tiny_model() -> None:
    assert cli.TINY_ARCHS == tiny_model.ARCHS
    assert cli.TINY_PRESETS == tuple(tiny_model.PRESETS)
