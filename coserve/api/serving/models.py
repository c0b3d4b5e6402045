"""`/v1/models`: the base models and the tenant's own fine-tuned models.

Reference: https://platform.openai.com/docs/api-reference/models. Another tenant's model is 404 like an
unknown one (`model_not_found`, OpenAI's wording). Deleting a base model is 403: the tenant can see it,
so "not found" would be false, and OpenAI answers a delete of a model the caller does not own with a
permission error (`openai.PermissionDeniedError`, which the client does not retry).
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Mapping
from pathlib import Path

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.models import Model, ModelDeleted, ModelList, ModelServing
from coserve.store import MetadataStore, ModelRecord

BASE_MODEL_OWNER = "system"


def to_model(record: ModelRecord, serving: ModelServing | None = None) -> Model:
    """The OpenAI `Model` of a stored model: base models are owned by "system", fine-tuned by their tenant;
    `parent` / `root` as vLLM's (see `coserve.api.protocol.models`); `serving`: the coserve extension
    of a base model this server serves (its engine and dtype)."""
    return Model(id=record.id, created=record.created_at, owned_by=record.tenant or BASE_MODEL_OWNER,
                 parent=record.base_model, root=record.base_model or record.id, coserve=serving)


def model_not_found(model_id: str) -> ProtocolError:
    """OpenAI's 404 for a model that does not exist or belongs to someone else."""
    return ProtocolError.not_found(f"The model `{model_id}` does not exist or you do not have access to it.",
                                   param="model", code="model_not_found")


class ModelsService:
    """The models endpoints.

    Args:
        store: where models are registered (base models at start-up, fine-tuned ones by jobs).
        serving: base model id -> the engine and dtype serving it (the `coserve` extension field); the
            models not in it have none.
    """

    def __init__(self, store: MetadataStore, serving: Mapping[str, ModelServing] | None = None) -> None:
        self.store = store
        self.serving = dict(serving or {})

    def _model(self, record: ModelRecord) -> Model:
        return to_model(record, self.serving.get(record.id) if record.tenant is None else None)

    def list_models(self, tenant: str) -> ModelList:
        """Base models first, then the tenant's fine-tuned models in creation order."""
        return ModelList(data=[self._model(r) for r in self.store.models.usable(tenant)])

    def retrieve(self, tenant: str, model_id: str) -> Model:
        """One model the tenant may use. Raises ProtocolError 404 `model_not_found` otherwise."""
        record = self.store.models.get(tenant, model_id)
        if record is None:
            raise model_not_found(model_id)
        return self._model(record)

    def export_adapter(self, tenant: str, model_id: str) -> tuple[str, bytes]:
        """(file name, `.tar.gz` bytes) of a fine-tuned model's PEFT folder, files at the top level.

        Raises:
            ProtocolError: 404 for an unknown or another tenant's model; 400 for a base model or one
                whose adapter folder is gone.
        """
        record = self.store.models.get(tenant, model_id)
        if record is None:
            raise model_not_found(model_id)
        folder = Path(record.adapter_path) if record.adapter_path else None
        if folder is None or not (folder / "adapter_config.json").is_file():
            raise ProtocolError(f"The model `{model_id}` has no LoRA adapter to export.", param="model",
                                code="no_adapter")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                tar.add(folder / name, arcname=name)
        return re.sub(r"[^A-Za-z0-9_.-]", "_", model_id) + ".tar.gz", buffer.getvalue()

    def delete(self, tenant: str, model_id: str) -> ModelDeleted:
        """Delete one of the tenant's fine-tuned models and its adapter folder (which frees its bytes and
        its place under the tenant's storage quotas).

        Raises:
            ProtocolError: 404 `model_not_found` for an unknown or another tenant's model; 403 for a base
                model; 400 `model_in_use` for a checkpoint of a job still active or the model an active
                job trains on from (see `_check_unused`).
        """
        record = self.store.models.get(tenant, model_id)
        if record is None:
            raise model_not_found(model_id)
        if record.tenant is None:
            raise ProtocolError(f"You do not have permission to delete the model `{model_id}`: only your own "
                                "fine-tuned models can be deleted.", status=403, param="model",
                                code="model_not_deletable")
        self._check_unused(tenant, record)
        if not self.store.models.delete(tenant, model_id):
            # Deleted by a concurrent request between the two calls: gone for this caller too.
            raise model_not_found(model_id)
        return ModelDeleted(id=model_id, deleted=True)

    def _check_unused(self, tenant: str, record: ModelRecord) -> None:
        """400 `model_in_use` while an active job needs the model's folder: a job resumes from its own
        latest checkpoint and starts from the adapter of the model it continues. Cancel the job or wait
        until it ends (a 400, not a 409, which the official client would retry)."""
        for job in self.store.jobs.active():
            if job.tenant != tenant or (job.id != record.job_id and job.model != record.id):
                continue
            role = "a checkpoint of" if job.id == record.job_id else "the model trained on by"
            raise ProtocolError(f"The model `{record.id}` is {role} fine-tuning job {job.id}, which is "
                                f"{job.status.value}: cancel the job or wait until it ends, then delete the "
                                "model.", param="model", code="model_in_use")
