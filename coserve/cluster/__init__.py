"""One or several engines under one scheduler (`EngineCluster`): iterations, routing, job placement, runs.
Imported by: actors, offline, server, bench.

The iteration loop (`engine_core.py`) and the retries of a failed step's pieces (`fault_isolation.py`),
routing with adapter and prefix affinity, work stealing, job placement (`jobs.py`: `ClusterJobs`), adapters
published to every engine, failover, the planner each engine gets (`policy_factory.py`), and the Tinker API's
training runs (`training_runs.py`, `run_saves.py`). A server has one or several engines; the offline `LLM`, one.
Pure Python."""
