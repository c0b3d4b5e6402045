"""`/v1/models`: the model objects (https://platform.openai.com/docs/api-reference/models/object).

Base models are owned by "system"; fine-tuned ones (`ft:...`, `...:ckpt-step-N`) by their tenant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coserve.api.protocol.base import OpenAIBaseModel, now


class Model(OpenAIBaseModel):
    """One servable model: a base model, a fine-tuned model or a checkpoint."""

    id: str
    created: int = Field(default_factory=now)
    object: Literal["model"] = "model"
    owned_by: str
    shutdown_date: str | None = None

    # --- coserve extensions ---
    parent: str | None = None  # the base model of a fine-tuned model or checkpoint; None for a base
    # --- end of coserve extensions ---


class ModelList(OpenAIBaseModel):
    """`GET /v1/models`: not paginated (the client's `SyncPage` never asks for a next page)."""

    object: Literal["list"] = "list"
    data: list[Model]


class ModelDeleted(OpenAIBaseModel):
    """The answer to `DELETE /v1/models/{model}`."""

    id: str
    deleted: bool
    object: str = "model"
