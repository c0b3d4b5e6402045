"""HTTP routes of `/v1/models` (https://platform.openai.com/docs/api-reference/models).

Model ids contain `:` and may contain `/` (HF names, `ft:...`), hence `{model:path}`. A route under a
model (`/v1/models/{model}/adapter`) must be registered BEFORE these, or `{model:path}` takes it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from coserve.api.auth import Tenant
from coserve.api.protocol.models import Model, ModelDeleted, ModelList
from coserve.api.serving.models import ModelsService
from coserve.api.state import GatewayState, get_state

router = APIRouter(prefix="/v1/models", tags=["models"])


def get_models_service(state: Annotated[GatewayState, Depends(get_state)]) -> ModelsService:
    """FastAPI dependency: the models service over the app's store."""
    serving = {} if state.serving is None else {model_id: state.serving for model_id in state.base_models}
    return ModelsService(state.store, serving)


Service = Annotated[ModelsService, Depends(get_models_service)]


@router.get("", response_model=ModelList)
def list_models(tenant: Tenant, service: Service) -> ModelList:
    """The base models and the tenant's fine-tuned models (not paginated, like OpenAI)."""
    return service.list_models(tenant)


@router.get("/{model:path}/adapter", response_class=Response)
def export_adapter(tenant: Tenant, service: Service, model: str) -> Response:
    """One of the tenant's fine-tuned models as its PEFT folder in a `.tar.gz`."""
    filename, content = service.export_adapter(tenant, model)
    return Response(content=content, media_type="application/gzip",
                    headers={"content-disposition": f'attachment; filename="{filename}"'})


@router.get("/{model:path}", response_model=Model)
def retrieve_model(tenant: Tenant, service: Service, model: str) -> Model:
    """One model the tenant may use (404 `model_not_found` otherwise)."""
    return service.retrieve(tenant, model)


@router.delete("/{model:path}", response_model=ModelDeleted)
def delete_model(tenant: Tenant, service: Service, model: str) -> ModelDeleted:
    """Delete one of the tenant's fine-tuned models (403 for a base model, 404 for unknown or others')."""
    return service.delete(tenant, model)
