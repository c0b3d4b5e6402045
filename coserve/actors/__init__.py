"""Plain classes wrapped by Ray in cluster mode and used in-process in local mode."""
