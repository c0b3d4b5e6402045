"""The processes' shells, plain classes wrapped by Ray in cluster mode and used in-process in local mode: the
scheduler actor (admission, token streams, its iteration loops, its fine-tuning side), the engine actor and its
supervisor, the gateway's scheduler client. Imported by the server, the CLI and the benchmarks only."""
