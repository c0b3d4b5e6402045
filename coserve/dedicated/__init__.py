"""Dedicated fine-tuning: a job trained outside the shared engines, as a Ray Train `TorchTrainer` of its
own (`run.DedicatedRun` drives it, `worker.train_loop` runs on every worker), with the co-served
trainer's data pipeline, loss, LoRA and checkpoint code. Which jobs go here: `coserve.policies.dedicated`."""
