"""Dedicated fine-tuning: a job trained outside the shared engines, as a Ray Train `TorchTrainer` of its
own (`run.DedicatedRun` drives it, `worker.train_loop` runs on every worker), with the co-served
trainer's data pipeline, loss, LoRA and checkpoint code; `capacity` what the cluster can hold. Which jobs go
here: `coserve.finetune.dedicated`; what crosses processes: `coserve.contract.dedicated_run`."""
