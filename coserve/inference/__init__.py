"""Inference as one engine's planner sees it: requests and their states, the inference planner (continuous
batching under a token budget, chunked prefill, admission order: VTC, the TTFT guard, fan-outs), KV block and
adapter slot bookkeeping, and the invariants every plan holds. Pure Python: it decides, the engine executes.
Imports contract and tenancy; imported by finetune, the planner, the cluster and the offline `LLM`."""
