"""Tenants and what they may use: the tenants file, quotas (rates, jobs, storage) and the virtual token
counters that share the machine fairly between them (one set, or one shared by several engines).
Pure Python."""
