"""Dedicated fine-tuning: a job trained on a Ray Train run of its own, outside the shared engines.
Imported by: jobs, server, cli.

`run.DedicatedRun` drives a Ray Train `TorchTrainer`, `worker.train_loop` runs on every worker, with the
co-served trainer's data pipeline, loss, LoRA and checkpoint code; `capacity` what the cluster can hold. Which
jobs go here: `coserve.finetune.dedicated`; what crosses processes: `coserve.contract.dedicated_run`."""
