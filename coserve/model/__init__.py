"""A model as coserve reads it: config, safetensors weights, tokenizer, PEFT folders, known models, GGUF.
Imported by: forward, trainer, frontend, dedicated, torch_engine, vllm, backends, actors, offline, server, bench, cli.
"""
