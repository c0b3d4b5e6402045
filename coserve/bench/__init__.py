"""Benchmarks shipped with coserve: `coserve bench trainer`, `coserve bench co-serving`, profiler, simulator.
Imported by: cli."""
