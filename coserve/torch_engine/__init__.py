"""coserve's own engine: `TorchEngine` executes one `IterationPlan` per call on torch (the forward, the
sampler and its logits processors, grammar masks, training work), and the registry that builds either
backend from an `EngineConfig`."""
