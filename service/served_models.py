"""Which models a tenant may call: the shared registered bases, its own succeeded jobs' adapters and the weights its
training sessions saved.

Another tenant's model resolves exactly like an unknown name (None), so a caller cannot probe for it.
"""

from __future__ import annotations

from moetune.api.model_names import parse_fine_tuned_name
from moetune.api.models.job_create import JobCreate
from moetune.api.serving import ModelObject, ServedModel
from moetune.service.base_models import BaseModels
from moetune.service.sessions.weights import SESSION_ID_PREFIX, saved_weights
from moetune.service.store import JobRow, Store
from moetune.service.views import job_view

SHARED_OWNER = "moetune"


def _tuned_model(row: JobRow, base_models: BaseModels) -> ModelObject:
    job = job_view(row, base_models)
    base_uri = base_models.uri(JobCreate.model_validate(row.spec).model)
    return ModelObject(id=job.fine_tuned_model, created=job.finished_at or job.created_at, owned_by=row.tenant,
                       moetune=ServedModel(base_model=base_models.name(job.model), base_model_uri=base_uri,
                                           adapter_uri=job.fine_tuned_model_uri, fine_tuning_job_id=job.id))


def _base_model(name: str, uri: str, base_models: BaseModels) -> ModelObject:
    return ModelObject(id=name, created=base_models.created, owned_by=SHARED_OWNER,
                       moetune=ServedModel(base_model=name, base_model_uri=uri))


def list_models(store: Store, base_models: BaseModels, tenant: str) -> list[ModelObject]:
    bases = [_base_model(name, uri, base_models) for name, uri in base_models.uris_by_name.items()]
    return (bases + [_tuned_model(row, base_models) for row in store.succeeded_jobs(tenant)]
            + saved_weights(store, base_models, tenant))


def find_model(store: Store, base_models: BaseModels, tenant: str, model: str) -> ModelObject | None:
    if model in base_models.uris_by_name:
        return _base_model(model, base_models.uris_by_name[model], base_models)
    parsed = parse_fine_tuned_name(model)
    if parsed and parsed.job_id.startswith(SESSION_ID_PREFIX):
        found = saved_weights(store, base_models, tenant, parsed.job_id, parsed.owner)
        return found[0] if found and found[0].id == model else None
    row = parsed and store.get_job(parsed.job_id, tenant)
    if not row or row.status != "succeeded":
        return None
    found = _tuned_model(row, base_models)
    return found if found.id == model else None  # the whole name must match, not only its job id
