"""coserve's own engine, `TorchEngine`: one `IterationPlan` per call on torch (forward, sampler, training).
Imported by: backends, bench."""
