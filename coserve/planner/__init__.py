"""How inference and fine-tuning share an engine: the co-serving policy (inference first, then
fine-tuning), the hybrid token share under the SLO with its latency model (fitted offline, refined
online), liveness (every job makes progress or says why not), and the baselines (temporal, dynamic
temporal, static split). Pure Python."""
