"""The control plane's configuration: one object, read from `MOETUNE_*` environment variables."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from moetune.api.environment import PASSTHROUGH_ENV
from moetune.api.images import ImageLimits
from moetune.api.models.base import URI_SCHEMES
from moetune.api.plans import parse_cluster
from moetune.service.base_models import parse_base_models
from moetune.service.quotas import TenantQuota


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MOETUNE_", frozen=True)

    database_url: str = "sqlite:///./.moetune/moetune.db"
    # "token1:tenantA,token2:tenantB"
    api_tokens: str = "dev-token:default"
    ray_address: str = "http://127.0.0.1:8265"  # Ray Jobs API (dashboard) URL
    max_running_jobs: int = 2
    # A job whose workers no node of the Ray cluster (or not all nodes together) could ever hold fails before it
    # is submitted. False on an autoscaling cluster: such a job waits queued, with its reason, for new nodes.
    fail_unschedulable: bool = True
    # ... but only once the cluster's nodes (as Ray's resource report shows them) have held still this long: the
    # report lags a node that just joined, or the nodes rejoining a restarted head. Until then such a job waits,
    # queued with its reason.
    unschedulable_grace_s: float = 30.0
    # A job whose max_steps x global_batch_size passes over its training file more often than this is refused
    # (422 naming training.max_steps) unless it sets training.allow_many_epochs.
    max_epochs: float = 100.0
    scheduler_enabled: bool = True
    # The leader deploys again what was deployed and the Serve app lost (a Ray head restart, `moetune down`/`up`).
    # Off where another control plane shares the Ray cluster and owns its Serve app (the e2e tests' shared one).
    restore_deployments: bool = True
    scheduler_interval_s: float = 1.0
    # Replicas share the database; the one holding the scheduler lease schedules (service/cluster/leader.py). It
    # renews every scheduler_lease_renew_s; a leader that stops is replaced scheduler_lease_s later at the latest
    # (plus one renewal and one interval: under 15 s with these defaults).
    scheduler_lease_s: float = 10.0
    scheduler_lease_renew_s: float = 3.0
    # Per tenant, JSON {"tenant": {"max_running_jobs": 2, "max_workers": 16, "gpu_hours": 500}, "*": {...}} ("*":
    # every tenant not named; a missing key: no limit). See service/quotas.py.
    tenant_quotas: dict[str, TenantQuota] = {}
    # Webhook deliveries (service/webhooks/): a failed one is retried after base, 2 x base, ... up to max seconds
    # (jittered), for retry_for seconds after its event (72 h like OpenAI's; never under 24 h) before it is given up.
    webhook_retry_base_s: float = 5.0
    webhook_retry_max_s: float = 3600.0
    webhook_retry_for_s: float = 72 * 3600.0
    webhook_timeout_s: float = 10.0  # per attempt; a slower receiver counts as a failure
    webhook_poll_interval_s: float = 1.0  # how soon a new event is sent
    callback_url: str = "http://127.0.0.1:8000"  # how workers reach this control plane
    default_output_uri: str = "s3://moetune/outputs"
    s3_endpoint_url: str | None = None  # S3-compatible endpoint; unset = AWS
    # Names of variables copied from this process's environment into every Ray job (comma-separated or JSON list).
    worker_env_passthrough: Annotated[list[str], NoDecode] = list(PASSTHROUGH_ENV)
    driver_entrypoint: str = "python -m moetune.workers.entry.driver"
    # Storage a tenant's jobs may use: JSON {"tenant": ["s3://bucket/", "s3://shared/models/"], "*": [...]}
    # ("*" applies to every tenant). Empty: any bucket. See service/submission/uri_policy.py.
    uri_allow_list: dict[str, list[str]] = {}
    # file:// lets a job read and write the workers' disks: only for single-user setups (the demo turns it on),
    # and only under the listed directories (JSON list, or comma-separated), which it then requires.
    allow_file_uris: bool = False
    file_uri_roots: Annotated[list[str], NoDecode] = []
    # The GPUs jobs run on, "nodes=8,gpus_per_node=8,gpu_memory=140GiB,nic=400Gbps" (api.plans.parse_cluster):
    # submission then refuses a GPU job whose parallelism cannot fit them (service/submission/planning.py). Unset: no check.
    cluster: str | None = None
    # Images in chat rows, as JSON, e.g. {"max_image_bytes": 5000000, "max_images_per_row": 4, "max_image_pixels":
    # 16000000}; the driver checks every image against them before any worker starts (api/images.py).
    image_limits: ImageLimits = ImageLimits()
    # At submission the control plane scans data files up to this size for image URIs (allow-list, vision tower);
    # the driver scans every file again, whatever its size.
    submission_scan_max_mb: float = 64.0
    # Where uploaded data files (POST /v1/files) are kept, one folder per tenant; unset: <the bucket of
    # default_output_uri>/files. The bucket is created on the first upload when it does not exist.
    files_uri: str | None = None
    max_upload_mb: float = 512.0
    # Registered base models, JSON {"name": "s3://..."} or "name=uri,name=uri" (service/base_models.py): usable by
    # name as a job's `model` and for inference, listed by GET /v1/models.
    base_models: Annotated[dict[str, str], NoDecode] = {}
    # A training session's worker group that is not ready this long after its submission (waiting for free workers,
    # loading a huge base from storage) fails the session with the cause, and its Ray job is stopped.
    session_start_timeout_s: float = Field(3600.0, gt=0)
    # Where clients reach the OpenAI-compatible Serve app (the Serve HTTP proxy on the Ray cluster, which listens on
    # this URL's port); POST .../jobs/{id}/deploy answers with it + "/v1".
    serve_url: str = "http://127.0.0.1:8001"

    @field_validator("worker_env_passthrough", "file_uri_roots", mode="before")
    @classmethod
    def _split_names(cls, value):
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [n.strip() for n in text.split(",") if n.strip()]
        return value

    @field_validator("base_models", mode="before")
    @classmethod
    def _base_models(cls, value):
        return parse_base_models(value)

    @field_validator("api_tokens")
    @classmethod
    def _well_formed_tokens(cls, value: str) -> str:
        parse_api_tokens(value)
        return value

    @field_validator("uri_allow_list")
    @classmethod
    def _uri_prefixes(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for tenant, prefixes in value.items():
            for prefix in prefixes:
                if not prefix.startswith(URI_SCHEMES) or not prefix.split("://", 1)[1].strip("/"):
                    raise ValueError(f"uri_allow_list[{tenant!r}]: {prefix!r} must be a URI with a bucket or "
                                     f"folder, starting with one of {', '.join(URI_SCHEMES)}")
        return value

    @field_validator("file_uri_roots")
    @classmethod
    def _absolute_roots(cls, value: list[str]) -> list[str]:
        if bad := [root for root in value if not root.startswith("/")]:
            raise ValueError(f"file_uri_roots: {bad[0]!r} must be an absolute directory")
        return [root.rstrip("/") or "/" for root in value]

    @model_validator(mode="after")
    def _file_uris_confined(self) -> Settings:
        if self.allow_file_uris and not self.file_uri_roots:
            raise ValueError("allow_file_uris needs file_uri_roots (MOETUNE_FILE_URI_ROOTS): the directories a "
                             "job's file:// URIs may name")
        return self

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cluster(value)
        return value

    @model_validator(mode="after")
    def _lease_outlives_renewals(self) -> Settings:
        if not 0 < self.scheduler_lease_renew_s < self.scheduler_lease_s:
            raise ValueError("scheduler_lease_renew_s must be > 0 and below scheduler_lease_s (a lease renewed "
                             "less often than it lasts lapses between renewals)")
        return self

    @model_validator(mode="after")
    def _webhook_retries(self) -> Settings:
        if not 0 < self.webhook_retry_base_s <= self.webhook_retry_max_s:
            raise ValueError("webhook_retry_base_s must be > 0 and at most webhook_retry_max_s")
        if self.webhook_retry_for_s < 24 * 3600:
            raise ValueError("webhook_retry_for_s must be at least 86400 (webhooks are retried for 24 h or more)")
        if self.webhook_timeout_s <= 0 or self.webhook_poll_interval_s <= 0:
            raise ValueError("webhook_timeout_s and webhook_poll_interval_s must be > 0")
        return self

    @field_validator("max_running_jobs")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0")
        return value

    @property
    def tenants_by_token(self) -> dict[str, str]:
        return parse_api_tokens(self.api_tokens)


def parse_api_tokens(spec: str) -> dict[str, str]:
    """`"tok1:tenantA,tok2:tenantB"` -> {"tok1": "tenantA", ...}; a malformed entry is a startup error."""
    tenants: dict[str, str] = {}
    for number, entry in enumerate(filter(None, (e.strip() for e in spec.split(","))), start=1):
        token, sep, tenant = entry.rpartition(":")
        if not sep or not token.strip() or not tenant.strip():
            # The entry itself is not echoed: it holds a secret.
            raise ValueError(f"api_tokens entry {number} must look like 'token:tenant'")
        tenants[token.strip()] = tenant.strip()
    if not tenants:
        raise ValueError("api_tokens must name at least one 'token:tenant'")
    return tenants
