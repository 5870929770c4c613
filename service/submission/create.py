"""Creating a job: its run config (resolved once, here), idempotency, the stored row and its first events."""

from __future__ import annotations

import hashlib
import json
import secrets

from moetune.api.checkpoint_files import check_tokenizer_files
from moetune.api.errors import ErrorCode
from moetune.api.families import check_model_spec
from moetune.api.models.base import SpecError
from moetune.api.models.job_create import JobCreate
from moetune.api.models.responses import JobStatus
from moetune.api.models.run_config import resolve_run_config
from moetune.service.base_models import BaseModels
from moetune.service.errors import APIException, invalid_request
from moetune.service.quotas import check_submission
from moetune.service.settings import Settings
from moetune.service.store import IdempotencyKeyTaken, JobRow, Store
from moetune.service.submission.data_images import check_data_images
from moetune.service.submission.inputs import resolve_inputs
from moetune.service.submission.job_storage import check_output_writable, model_files, read_model_config
from moetune.service.submission.limits import check_epochs, schedule_warnings
from moetune.service.submission.planning import check_fits
from moetune.service.submission.storage_facts import StorageFacts
from moetune.service.submission.uri_policy import check_job_uris, tenant_access

MAX_SEED = 2**31 - 1


def new_job_id() -> str:
    return f"ftjob-{secrets.token_hex(12)}"


def request_hash(request: JobCreate) -> str:
    """Equal for equal requests, whatever their key order, whitespace or spelled-out defaults."""
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _replay(existing: JobRow, digest: str) -> JobRow:
    if existing.request_hash != digest:
        raise APIException(409, ErrorCode.idempotency_key_reused,
                           "This Idempotency-Key was already used with a different request body.")
    return existing


def create_job(store: Store, settings: Settings, tenant: str, request: JobCreate, base_models: BaseModels,
               idempotency_key: str | None = None, facts: StorageFacts | None = None) -> JobRow:
    """The new job, or the one an earlier identical request with the same Idempotency-Key created. `facts`: what
    storage confirmed for recent creates (the model's config and files, the output location) is not asked again."""
    digest = request_hash(request)
    if idempotency_key is not None and (existing := store.find_by_idempotency_key(tenant, idempotency_key)):
        return _replay(existing, digest)
    request = resolve_inputs(request, store, tenant, base_models)
    check_job_uris(request, tenant, settings)
    job_id = new_job_id()
    location = (request.output_uri or settings.default_output_uri).rstrip("/")
    output_uri = f"{location}/{job_id}"
    seed = request.seed if request.seed is not None else secrets.randbelow(MAX_SEED + 1)
    try:
        run_config = resolve_run_config(request, seed)
        # Rules that need storage (the model's files, the output location); what storage cannot answer now, the
        # driver checks before any worker starts.
        if (config := read_model_config(request.model, settings.s3_endpoint_url, facts)) is not None:
            check_model_spec(config, request.lora, run_config.parallelism)
            if (plan := check_fits(config, run_config, request.training.activation_checkpointing == "auto",
                                   settings)) is not None:
                run_config = resolve_run_config(request, seed, plan)  # the plan decides activation_checkpointing
            if (names := model_files(request.model, settings.s3_endpoint_url, facts)) is not None:
                check_tokenizer_files(names, request.model)
        rows = check_data_images(request, config, tenant_access(tenant, settings), settings, facts)
        check_epochs(run_config.training, rows.get("training_file"), settings.max_epochs)
        check_output_writable(location, job_id, settings.s3_endpoint_url, default=request.output_uri is None,
                              facts=facts)
    except SpecError as e:
        raise invalid_request(e.message, e.param) from None
    check_submission(store, settings.tenant_quotas, tenant, run_config.parallelism)
    row = JobRow(
        id=job_id,
        tenant=tenant,
        status=JobStatus.validating_files.value,
        priority=request.priority,
        spec=request.model_dump(mode="json"),
        run_config=run_config.model_dump(mode="json"),
        seed=seed,
        output_uri=output_uri,
        result_files=[],
        progress={},
        idempotency_key=idempotency_key,
        request_hash=digest,
        cancel_requested=False,
        gpus=run_config.parallelism.num_workers * run_config.parallelism.gpus_per_worker,
    )
    try:
        warnings = [(warning, "warn") for warning in schedule_warnings(run_config.training,
                                                                        rows.get("training_file"))]
        return store.create_job(row, ["Job created", *warnings, "Validating files"])
    except IdempotencyKeyTaken:  # an identical request raced this one
        return _replay(store.find_by_idempotency_key(tenant, idempotency_key), digest)
