"""Which engine executes the plans: the registry of backends, above both engines.
Imported by: actors, offline, bench."""
