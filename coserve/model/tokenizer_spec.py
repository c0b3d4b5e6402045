"""The engine's `TokenizerSpec`: the model's tokenizer as transformers loads it, serialized for the gateway
and the scheduler, which rebuild it without torch (`coserve.frontend.tokenizer.Tokenizer.from_spec`)."""

from __future__ import annotations

from pathlib import Path

from coserve.contract.engine import TokenizerSpec


def read_tokenizer_spec(model_dir: str | Path) -> TokenizerSpec:
    """`AutoTokenizer.from_pretrained(model_dir)`'s fast tokenizer, special tokens and chat template(s).

    Raises:
        ValueError: the model has no fast (`tokenizers`) tokenizer.
    """
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{model_dir}: transformers loads no fast tokenizer for this model; coserve needs one")
    return TokenizerSpec(tokenizer_json=backend.to_str(), special_tokens=dict(hf.special_tokens_map),
                         chat_template=hf.chat_template)
