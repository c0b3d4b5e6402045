"""FastAPI routers, one module per endpoint: HTTP in and out only, logic lives in `coserve.api.serving`."""
