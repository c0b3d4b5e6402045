"""A coserve server built from its settings: `options` (`ServeOptions`, the flags of `coserve serve`)
and `assembly` (the gateway, scheduler and engine wired in one process or on Ray)."""
