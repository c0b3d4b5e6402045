"""One or several engines under one scheduler: the iteration loop (`EngineCore`), routing with adapter
and prefix affinity, work stealing, job placement, adapters published to every engine, failover, and the
policy a scheduler builds. Pure Python."""
