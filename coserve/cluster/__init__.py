"""One or several engines under one scheduler (`EngineCluster`): the iteration loop (`EngineCore`), routing with
adapter and prefix affinity, work stealing, job placement, adapters published to every engine, failover, the
planner each engine gets (`policy_factory`), and the Tinker API's training runs. Pure Python; imports the
planner and what is below it; imported by the scheduler actor, the offline `LLM`, the server and the benchmarks."""
