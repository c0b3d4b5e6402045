"""The OpenAI-compatible gateway (and the Tinker API): protocol models, serving logic, FastAPI routers.
Imported by: server, bench.

The OpenAI-compatible gateway: protocol models, serving logic and FastAPI routers per endpoint.

Layout (one triad per endpoint): `protocol/` (pydantic models, no I/O), `serving/` (request -> scheduler
-> response), `routers/` (FastAPI only). Nothing here imports torch."""
