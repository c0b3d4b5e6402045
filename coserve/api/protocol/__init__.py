"""Pydantic models of the OpenAI wire protocol, one module per endpoint plus the shared `base`.

Request models validate client input (errors become 400 `invalid_request_error` via
`base.error_from_validation`); response models dump to JSON the official `openai` client parses.
Pure data: no FastAPI, no torch.
"""
