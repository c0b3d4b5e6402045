"""A coserve server built from its settings: `ServeOptions`, and the assembly in one process or on Ray.
Imported by: cli."""
