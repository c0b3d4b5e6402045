"""One fused forward over a ragged token batch: transformer, paged attention, RoPE, the multi-LoRA bank.
Imported by: trainer, torch_engine, vllm, dedicated, bench."""
