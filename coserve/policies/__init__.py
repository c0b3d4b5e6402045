"""Pure-Python policy layer: requests, the iteration plan, KV block bookkeeping, schedulers.

Nothing in this package imports torch or Ray; it decides, the engine executes.
"""
