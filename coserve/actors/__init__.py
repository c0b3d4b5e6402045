"""The processes' shells: the scheduler actor and its parts, the engine actor and supervisor, the client.
Imported by: server, bench, cli.

Plain classes, wrapped by Ray in cluster mode and used in-process in local mode: the scheduler actor
(`scheduler_actor.py`: admission, token streams, its engines' iteration loops; its fine-tuning side
`fine_tuning.py`; how a failed step ends its work `step_faults.py`; metrics), the engine actor and its
supervisor, and the gateway's scheduler client (`client.py`)."""
