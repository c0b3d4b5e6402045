"""A fine-tuning job's lifecycle on the scheduler's side: its data prepared (rows -> tokenized, loss-masked
examples), validated, started, resumed, watched, its events recorded and its failures reported, and the
dedicated runs it may go to. Imports the packages below it (contract, tenancy, store, frontend, graders,
finetune); imported by the scheduler actor, the offline `LLM`, the server and the benchmarks."""
