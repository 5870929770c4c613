"""OpenAI's model routes for the caller's tenant, and the deploy call that serves a job's model."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from moetune.api.errors import ErrorCode
from moetune.api.models.job_create import JobCreate
from moetune.api.models.responses import JobStatus
from moetune.api.serving import Deployment, ModelList, ModelObject
from moetune.service.cluster import deployments as recorded_deployments, serve_deploy
from moetune.service.errors import APIException, job_not_found, documented_errors
from moetune.service.routes.deps import JobView, StoreDep, Tenant
from moetune.service.served_models import find_model, list_models

_ERRORS = documented_errors(
    (401, "Missing or invalid API token"),
    (404, "No such model (or job) for this tenant"),
)
models = APIRouter(prefix="/v1/models", tags=["models"], responses=_ERRORS)
deployments = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], responses={
    **_ERRORS, **documented_errors((409, "The job has not succeeded"),
                                   (503, "Ray Serve did not accept the application"))})


def model_not_found() -> APIException:
    # the same answer, byte for byte, for an unknown model and another tenant's: nothing tells them apart
    return APIException(404, ErrorCode.model_not_found,
                        "The model does not exist or you do not have access to it.", "model")


@models.get("", response_model=ModelList, response_model_exclude_none=True)
def list_all(request: Request, tenant: Tenant, store: StoreDep) -> ModelList:
    """The shared registered bases and the tenant's fine-tuned models."""
    data = list_models(store, request.app.state.base_models, tenant)
    return ModelList(data=[m.model_copy(update={"moetune": None}) for m in data])


@models.get("/{model:path}", response_model=ModelObject)
def retrieve(model: str, request: Request, tenant: Tenant, store: StoreDep) -> ModelObject:
    """One model, with the base and adapter URIs a serving replica loads (`moetune`)."""
    found = find_model(store, request.app.state.base_models, tenant, model)
    if found is None:
        raise model_not_found()
    return found


@deployments.post("/{job_id}/deploy", response_model=Deployment)
async def deploy_job(job_id: str, request: Request, tenant: Tenant, store: StoreDep, job_view: JobView) -> Deployment:
    """Makes the Serve app serve the job's base (its adapters load on first use); answers the name to call."""
    row = store.get_job(job_id, tenant)
    if row is None:
        raise job_not_found(job_id)
    if row.status != JobStatus.succeeded:
        raise APIException(409, ErrorCode.job_not_deployable,
                           f"Job {job_id!r} is {row.status}: only a succeeded job has a model to serve.")
    job, settings, base_models = job_view(row), request.app.state.settings, request.app.state.base_models
    base_uri = base_models.uri(JobCreate.model_validate(row.spec).model)
    status = await run_in_threadpool(recorded_deployments.deploy, store, settings,
                                     {base_models.name(base_uri): base_uri})
    return Deployment(model=job.fine_tuned_model, base_model=base_models.name(base_uri),
                      base_url=serve_deploy.openai_base_url(settings.serve_url), status=status)


inference = APIRouter(prefix="/v1", include_in_schema=False)


@inference.post("/chat/completions")
@inference.post("/completions")
def inference_lives_on_the_serve_app(request: Request, _tenant: Tenant) -> None:
    """OpenAI clients pointed at the control plane by mistake learn where the tuned models answer."""
    serve = serve_deploy.openai_base_url(request.app.state.settings.serve_url)
    raise APIException(404, ErrorCode.not_found, f"The control plane does not run models: send {request.url.path} "
                                                 f"to the Serve app at {serve} (POST /v1/fine_tuning/jobs/{{id}}/deploy "
                                                 f"starts it).")
