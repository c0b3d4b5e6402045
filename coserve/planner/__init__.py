"""The per-engine co-serving planner: how inference and fine-tuning share an engine. The co-serving policy
(inference first, then fine-tuning) with its share strategies (the hybrid share under the SLO with its latency
model, fitted offline and refined online; the baselines: temporal, dynamic temporal, static split) and
liveness (every job makes progress or says why not). Pure Python; imports contract, tenancy, inference and
finetune, and is imported by the cluster (one planner per engine), the offline `LLM`, the server and the
benchmarks."""
