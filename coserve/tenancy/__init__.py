"""Tenants and what they may use: the tenants file, quotas (rates, jobs, storage), the virtual token counters.
Imported by: inference, finetune, planner, cluster, graders, jobs, api, actors, server, bench."""
