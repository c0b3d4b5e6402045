"""`/v1/models`: the model objects (https://platform.openai.com/docs/api-reference/models/object).

Base models are owned by "system"; fine-tuned ones (`ft:...`, `...:ckpt-step-N`) by their tenant.
`parent` and `root` are vLLM's: for a fine-tuned model or checkpoint both name its base model (vLLM's
`root` is the adapter's folder, which a client has no use for); for a base model `root` is itself.
A base model this server serves also carries the coserve extension `coserve`: the engine serving it and
the dtype its weights are in (`ModelServing`); null on the other models.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coserve.api.protocol.base import OpenAIBaseModel, now


class ModelServing(OpenAIBaseModel):
    """How a base model is served: `engine` ("torch" or "vllm", `coserve serve --engine`) and `dtype`
    ("float32", "bfloat16", "float16": `--dtype`, with "auto" resolved to the model config's dtype)."""

    engine: str
    dtype: str


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

    # --- coserve extensions ---
    coserve: ModelServing | None = None  # the engine and dtype serving a base model of this server
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
