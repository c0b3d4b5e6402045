"""The offline API, shaped like vLLM's: `LLM` (generate, chat, fine-tune in one process, no server),
`LoRARequest`, the output objects, and `coserve demo`. `from coserve import LLM, SamplingParams,
LoRARequest` re-exports them."""
