"""Create tiny random HF-format models (Llama, Qwen2, Qwen3, Mistral) for tests and the demo.

There is no model hub on coserve's test machines, so models are made here: a BPE tokenizer trained
from the packaged corpus (`tokenizer_train.py`), a config built with the installed `transformers`
config class of the family, and seeded random weights saved as float32 safetensors.

The weights are not the HF default init. With std-0.02 weights every logit is near zero, so greedy
decoding is a coin toss that two correct implementations can disagree on through float rounding,
and tied-embedding models just repeat the last token. `_init_peaked_weights` instead draws weights
so that (1) logits have a standard deviation of about `LOGIT_STD`, which puts the median top-1/top-2
gap at several units, (2) every layer writes more into the residual stream than the token
embedding does, so the next token depends on the context (attention and RoPE bugs change the
output) rather than on the current token alone, and (3) norm weights and biases are
random rather than 1 and 0, so an implementation that skips one of them produces different logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from coserve.model.chat_formats import ChatFormat, default_chat_format
from coserve.model.tokenizer_train import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    save_tokenizer,
    special_token_ids,
    train_tokenizer,
)

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=256, max_position_embeddings=2048, vocab_size=2048),
    # ~26M parameters with tied embeddings, ~30M untied.
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, intermediate_size=1280, max_position_embeddings=4096, vocab_size=8192),
}
# Per-family defaults, as the real checkpoints of each family have them.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(tie_word_embeddings=False, rms_norm_eps=1e-5),
    "qwen2": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None),
    "qwen3": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None),
    "mistral": dict(tie_word_embeddings=False, rms_norm_eps=1e-5, sliding_window=None),
}
ROPE_THETA = {"tiny": 10000.0, "small": 500000.0}
# Llama 3.1 style scaling; original_max_position_embeddings is set to max_position_embeddings / factor.
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
MIN_HEAD_DIM = 32

# Weight scales of the peaked init (see the module docstring), chosen by measuring greedy decoding
# of the tiny and small presets: the median top-1/top-2 logit gap is about 4, 40-step generations
# are mostly distinct tokens, the next token after random contexts ending in the same token differs
# in 24-32 of 32 contexts, and fp32 eager vs SDPA+KV-cache greedy decodes agree token for token.
# Sharper attention (q/k gains > 1) adds variety but makes bf16 runs diverge from fp32 sooner.
LOGIT_STD = 20.0
EMBED_STD = 1.0
BIAS_STD = 0.5
# Output scale of each projection per unit of input scale (std = gain / sqrt(fan_in)). Layers write
# 2-4x more than the embedding into the residual stream, so tied models do not echo the last token.
LINEAR_GAINS = {"q_proj": 1.0, "k_proj": 1.0, "v_proj": 1.0, "o_proj": 3.0,
                "gate_proj": 2.0, "up_proj": 2.0, "down_proj": 4.0}


def create_tiny_model(path: str | Path, arch: str = "llama", preset: str = "tiny", seed: int = 0,
                      device: str = "cpu", chat_format: ChatFormat | None = None, **overrides: Any) -> Path:
    """Write a random `arch` model of size `preset` to `path` and return the path.

    `chat_format` is its chat template and the special tokens that go with it (`chat_formats.py`: the
    real Llama 3.2 or Mistral Nemo templates, ...); by default ChatML, Qwen's tool format for qwen2/qwen3.
    `overrides` set config fields (`num_key_value_heads=1`, `tie_word_embeddings=True`, `head_dim=48`,
    `attention_bias=True`, ...). `rope_theta` and `rope_scaling` (a dict, or None for plain RoPE) are
    folded into `rope_parameters`. `vocab_size` sets the tokenizer's training target too.
    `device`: where the weights are drawn (a real-size shape draws in seconds on a GPU, a minute on a
    CPU); the files are float32 either way. The same (arch, preset, seed, overrides) always gives the
    same files on one kind of device (the CPU's and CUDA's random streams differ).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    path = Path(path)
    chat_format = chat_format or default_chat_format(arch)
    requested_vocab = int(overrides.get("vocab_size", PRESETS[preset]["vocab_size"]))
    # At most requested_vocab tokens, the chat format's special tokens included.
    tokenizer = train_tokenizer(requested_vocab, chat_format.added_specials)
    # Without an explicit vocab_size the embedding matches the tokenizer exactly (no unused rows).
    overrides.setdefault("vocab_size", tokenizer.get_vocab_size())
    overrides.setdefault("bos_token_id", tokenizer.token_to_id(chat_format.bos))
    overrides.setdefault("eos_token_id", tokenizer.token_to_id(chat_format.eos))
    config = build_config(arch, preset, **overrides)

    where = torch.device(device)
    # Leave the caller's global RNG untouched (the device's too).
    with torch.random.fork_rng(devices=[where] if where.type != "cpu" else [], device_type=where.type), where:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _init_peaked_weights(model, torch.Generator(where).manual_seed(seed))
    model.generation_config = _generation_config(config)
    model.save_pretrained(path, safe_serialization=True)
    _add_legacy_keys(path / "config.json")
    save_tokenizer(tokenizer, path, model_max_length=config.max_position_embeddings,
                   chat_template=chat_format.template, bos=chat_format.bos, eos=chat_format.eos)
    return path


def build_config(arch: str, preset: str = "tiny", **overrides: Any) -> PretrainedConfig:
    """The transformers config of a tiny `arch` model: preset, family defaults, then `overrides`."""
    if arch not in CONFIG_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(ARCHS)}")
    config_class = CONFIG_CLASSES[arch]
    ids = special_token_ids()
    fields: dict[str, Any] = {**PRESETS[preset], **ARCH_DEFAULTS[arch], "hidden_act": "silu",
                              "bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN],
                              "pad_token_id": ids[PAD_TOKEN], "dtype": "float32"}
    if arch == "qwen2":
        # Real Qwen2 configs have no head_dim (it is hidden_size / heads); keep the file faithful.
        fields.pop("head_dim")
    rope_theta = overrides.pop("rope_theta", ROPE_THETA[preset])
    rope_scaling = overrides.pop("rope_scaling", LLAMA3_ROPE_SCALING if arch == "llama" else None)
    _check_override_names(config_class, overrides)
    fields.update(overrides)
    if arch in ("qwen2", "qwen3"):
        fields.setdefault("max_window_layers", fields["num_hidden_layers"])
    if "rope_parameters" not in overrides:
        fields["rope_parameters"] = _rope_parameters(rope_theta, rope_scaling, fields["max_position_embeddings"])
    config = config_class(**fields)
    _check_shapes(config)
    return config


def _check_override_names(config_class: type[PretrainedConfig], overrides: dict[str, Any]) -> None:
    """Reject misspelled overrides: config classes would silently store any unknown keyword."""
    known = set(config_class().to_dict()) | {"head_dim", "vocab_size"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{config_class.__name__} has no field(s) {unknown}")


def _rope_parameters(theta: float, scaling: dict[str, Any] | None, max_positions: int) -> dict[str, Any]:
    """transformers 5.x `rope_parameters`: the theta plus the scaling dict, if any."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": float(theta)}
    params = {**scaling, "rope_theta": float(theta)}
    if params.get("rope_type") == "llama3":
        params.setdefault("original_max_position_embeddings", int(max_positions // params["factor"]))
    return params


def _check_shapes(config: PretrainedConfig) -> None:
    """Fail early on shapes that the coserve engine does not support."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < MIN_HEAD_DIM or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= {MIN_HEAD_DIM}, got {head_dim}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


def _generation_config(config: PretrainedConfig) -> GenerationConfig:
    """Greedy by default; generation stops at `<|im_end|>`, the end of an assistant turn."""
    return GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, do_sample=False)


@torch.no_grad()
def _init_peaked_weights(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Overwrite every parameter with the peaked init described in the module docstring."""
    hidden: int = model.config.hidden_size
    done: set[int] = set()
    for module_name, module in model.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) or leaf == "lm_head":
            # Embedding and untied lm_head alike; a tied lm_head is the same tensor and is skipped.
            _fill_normal(module.weight, EMBED_STD, generator, done)
        elif isinstance(module, torch.nn.Linear):
            gain = LINEAR_GAINS.get(leaf, 1.0)
            _fill_normal(module.weight, gain / module.in_features ** 0.5, generator, done)
            if module.bias is not None:
                _fill_normal(module.bias, BIAS_STD, generator, done)
        elif "norm" in leaf and getattr(module, "weight", None) is not None:
            # The final norm sets the logit scale: logits = (norm(h) * w) @ E.T with E ~ N(0, EMBED_STD).
            base = LOGIT_STD / (EMBED_STD * hidden ** 0.5) if module_name == "model.norm" else 1.0
            # Random in [0.5, 1.5) x base: a skipped norm weight must change the result.
            weight = module.weight
            weight.copy_(base * (0.5 + torch.rand(weight.shape, generator=generator)))
            done.add(id(weight))
    missed = [name for name, param in model.named_parameters() if id(param) not in done]
    if missed:
        raise RuntimeError(f"peaked init does not know how to initialise {missed}")


def _fill_normal(param: torch.Tensor, std: float, generator: torch.Generator, done: set[int]) -> None:
    """Fill `param` from N(0, std) once (tied tensors are visited twice)."""
    if id(param) in done:
        return
    param.copy_(torch.randn(param.shape, generator=generator) * std)
    done.add(id(param))


def _add_legacy_keys(config_path: Path) -> None:
    """Also write the pre-5.0 RoPE spelling (top-level `rope_theta`, `rope_scaling`) in config.json.

    transformers 5.x writes only `rope_parameters`; transformers 4.x, vLLM and most
    hand-written loaders read `rope_theta` and `rope_scaling` (as real Llama 3 checkpoints spell
    them). transformers 5.x reads the legacy keys back into the same values, so both spellings agree.
    `torch_dtype` is not added: transformers 5.x warns on every load when it sees it.
    """
    config = json.loads(config_path.read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    config["rope_theta"] = rope.get("rope_theta")
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    config["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def create_random_adapter(model_dir: str | Path, out: str | Path, *, seed: int = 0,
                          b_std: float = 0.02, **lora: Any) -> Path:
    """Save a PEFT LoRA adapter for `model_dir` whose B matrices are random rather than zero.

    PEFT initialises B to zero, which makes a fresh adapter a no-op; tests, the demo and benchmarks
    need one that changes outputs. `lora` goes to `peft.LoraConfig` (r, lora_alpha, target_modules,
    use_rslora, ...). An adapter already saved at `out` is reused. Seeded; the caller's RNG is untouched.
    """
    from peft import LoraConfig, get_peft_model

    out = Path(out)
    if (out / "adapter_model.safetensors").is_file():
        return out
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # lora_A's Kaiming init draws from the global generator
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                               LoraConfig(**lora))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    model.save_pretrained(str(out))
    return out


def count_parameters(path: str | Path) -> int:
    """Number of parameters saved in `path`'s safetensors files (tied weights are stored once).

    Reads only the file headers, so it costs milliseconds even for large models.
    """
    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                total += math.prod(handle.get_slice(name).get_shape())
    return total
