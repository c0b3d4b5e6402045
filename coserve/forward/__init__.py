"""One fused forward over a ragged token batch: the transformer (Llama, Qwen2, Qwen3, Mistral), attention
over the paged KV cache (and its C decode kernel), RoPE, and the multi-LoRA bank. Shared by the engine,
which serves with it, and the trainer, which recomputes and differentiates it."""
