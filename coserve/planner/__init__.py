"""The per-engine co-serving planner: the co-serving policy, its share strategies, latency models, liveness.
Imported by: cluster, offline, server, bench.

How inference and fine-tuning share an engine: the co-serving policy (`policy.py`: inference first,
then fine-tuning) with its share strategies (`strategy.py`; the hybrid share under the SLO with its latency
model, fitted offline and refined online; the baselines: temporal, dynamic temporal, static split; `fill.py`:
no SLO, offline) and liveness (every job makes progress or says why not). Pure Python."""
