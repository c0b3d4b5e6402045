"""Structured output before the engine: a spec's llguidance grammar and the guarded check it can hold.
Imported by: frontend, torch_engine, vllm, offline.

Structured output before the engine: a spec's llguidance grammar (`llguidance_grammar`) and the check
that llguidance can enforce it, run in a worker process under a memory and time budget
(`guarded_check`, `check_worker`), so that no input costs more than its sender's refusal.

The sizes a spec may have are bounded earlier, when it is made (`coserve.contract.schema_limits`)."""
