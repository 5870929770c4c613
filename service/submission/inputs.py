"""What a job request names by handle, turned into the URIs the checks and the workers read: a registered base
model's name (service/base_models.py) and uploaded files' ids (service/routes/files.py)."""

from __future__ import annotations

from moetune.api.models.base import FILE_ID_PREFIX
from moetune.api.models.job_create import JobCreate
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
        if (value := getattr(request, field)) is not None:
            update[field] = _file_uri(value, field, "fine-tune", store, tenant)
    if request.evaluation is not None:
        update["evaluation"] = request.evaluation.model_copy(
            update={"file": _file_uri(request.evaluation.file, "evaluation.file", "evaluation", store, tenant)})
    return request.model_copy(update=update)


def _file_uri(value: str, field: str, purpose: str, store: Store, tenant: str) -> str:
    """The stored URI of an uploaded file's id (checked on upload by the rules of `purpose`); a URI unchanged."""
    if not value.startswith(FILE_ID_PREFIX):
        return value
    file = store.get_file(value, tenant)
    if file is None:
        raise invalid_request(f"{field}: no uploaded file has the id {value!r} (GET /v1/files lists them)", field)
    if file.purpose != purpose:
        raise invalid_request(f"{field}: file {value} was uploaded with purpose {file.purpose!r}; this field takes "
                              f"a file uploaded with purpose {purpose!r}", field)
    return file.uri
