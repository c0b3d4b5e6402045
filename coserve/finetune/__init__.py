"""Fine-tuning jobs as one engine's planner sees them: batch sources, batches, sequences, their work.
Imported by: planner, cluster, jobs, dedicated, actors, offline, server, bench.

A co-served job (`job.py`: `CoservedJob`) asks its method's batch source (`batch_source.py`: supervised,
DPO, reinforcement, driven by the Tinker API's calls, validation; picked in `methods.py`) for batches, plans the
one in flight (`batch_run.py`) into forward windows, backward tasklets, optimizer steps and saves, and holds an
adapter slot (`job_slot.py`); the roster of one engine's jobs, their checkpoints, which jobs run dedicated, a
reinforcement job's rollout loop. Pure Python."""
