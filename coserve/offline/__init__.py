"""The offline API, shaped like vLLM's: `LLM` (a cluster of one engine), `LoRARequest`, outputs, the demo.
Imported by: cli (and `coserve` itself)."""
