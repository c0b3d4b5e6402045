"""Inference as one engine's planner sees it: requests, the inference planner, KV blocks, adapter slots.
Imported by: finetune, planner, cluster, actors, offline, bench.

Requests and their states (`request.py`, `request_book.py`), the inference planner (`planner.py`:
continuous batching under a token budget, chunked prefill) and its admission order (`admission_order.py`: VTC,
the TTFT guard, fan-outs), KV blocks and adapter slots, and the invariants every plan holds. Pure Python: it
decides, the engine executes."""
