"""What a job request names by handle, turned into the URIs the checks and the workers read: a registered base
model's name (service/base_models.py) and uploaded files' ids (service/uploaded_files.py)."""

from __future__ import annotations

from moetune.api.models import FILE_ID_PREFIX, JobCreate
from moetune.service.base_models import BaseModels
from moetune.service.errors import invalid_request
from moetune.service.store import Store


def resolve_inputs(request: JobCreate, store: Store, tenant: str, base_models: BaseModels) -> JobCreate:
    """A copy of `request` with URIs only; a 422 naming the field for an unknown name or id."""
    update = {}
    if (model := request.model if "://" in request.model else base_models.uri(request.model)) is None:
        raise invalid_request(f"model: no registered base model is named {request.model!r} (GET /v1/models lists "
                              f"them; a checkpoint folder's URI works too)", "model")
    update["model"] = model
    for field in ("training_file", "validation_file"):
        value = getattr(request, field)
        if value is not None and value.startswith(FILE_ID_PREFIX):
            file = store.get_file(value, tenant)
            if file is None:
                raise invalid_request(f"{field}: no uploaded file has the id {value!r} (GET /v1/files lists them)",
                                      field)
            update[field] = file.uri
    return request.model_copy(update=update)
