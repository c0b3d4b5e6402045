"""`/v1/models`: the model objects (https://platform.openai.com/docs/api-reference/models/object).

Base models are owned by "system"; fine-tuned ones (`ft:...`, `...:ckpt-step-N`) by their tenant.
`parent` and `root` are vLLM's: for a fine-tuned model or checkpoint both name its base model (vLLM's
`root` is the adapter's folder, which a client has no use for); for a base model `root` is itself.
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

    # --- extensions, as vLLM's model card ---
    parent: str | None = None  # the base model of a fine-tuned model or checkpoint; None for a base
    root: str | None = None  # the base model the weights come from: the model itself for a base
    # --- end of extensions ---


class ModelList(OpenAIBaseModel):
    """`GET /v1/models`: not paginated (the client's `SyncPage` never asks for a next page)."""

    object: Literal["list"] = "list"
    data: list[Model]


class ModelDeleted(OpenAIBaseModel):
    """The answer to `DELETE /v1/models/{model}`."""

    id: str
    deleted: bool
    object: str = "model"
