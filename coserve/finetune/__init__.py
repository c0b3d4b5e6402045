"""Fine-tuning jobs as the scheduler sees them: a job's data order, batches and sequences, the work they
need (forward windows, backward tasklets, optimizer steps, saves), the roster of one engine's jobs,
their checkpoints, and which jobs run dedicated. Pure Python."""
