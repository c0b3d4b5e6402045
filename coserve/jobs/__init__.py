"""A fine-tuning job's lifecycle on the scheduler's side: its data, validation, start, resume, events, watchdog.
Imported by: actors, offline, bench.

The job manager (`manager.py`) keeps the runners' jobs in line with the store: a job's files read and
tokenized (`training_data.py`, `preference_data.py`, `reinforcement_data.py`, `prepared_job.py`) and checked
(`preparation.py`, `storage.py`), resumed from its checkpoint (`resume.py`), its events recorded (`events.py`)
and its failures reported (`failures.py`), watched (`watchdog.py`); large jobs go to dedicated Ray Train runs
(`dedicated_jobs.py`, `dedicated_job.py`, `leftover_groups.py`). Torch-free."""
