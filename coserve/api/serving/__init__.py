"""Serving layer of the gateway: request objects in, protocol objects out, `ProtocolError` on failure.

No FastAPI here: routers translate HTTP to these calls, so the logic is testable without a server.
"""
