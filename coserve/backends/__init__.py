"""Which engine executes the plans: the registry of backends (`EngineKind` -> its builder), above both engines
(`torch_engine/`, `vllm/`), neither of which imports the other. Imported by whoever builds an engine: the
engine actor, the offline `LLM`, the benchmarks."""
