"""The inference scheduler: requests and their states, continuous batching under a token budget, chunked
prefill, admission order (VTC, the TTFT guard, fan-outs), KV block and adapter slot bookkeeping, and the
invariants every plan holds. Pure Python: it decides, the engine executes."""
