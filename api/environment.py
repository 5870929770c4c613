"""The environment variables of a job, in one place: what the control plane sets for a Ray job's driver, what the
driver hands on to its workers, and what the workers read (moetune.workers.settings parses them, once)."""

from __future__ import annotations

ENV_RUN_SPEC = "MOETUNE_RUN_SPEC"  # JobRunSpec as JSON
ENV_CALLBACK_URL = "MOETUNE_CALLBACK_URL"  # control plane base URL for reports
ENV_JOB_TOKEN = "MOETUNE_JOB_TOKEN"  # per-job bearer token for the report endpoint
ENV_S3_ENDPOINT_URL = "MOETUNE_S3_ENDPOINT_URL"  # S3-compatible endpoint (MinIO, Ceph, R2, local); unset = AWS
ENV_MAX_WORKER_FAILURES = "MOETUNE_MAX_WORKER_FAILURES"  # worker-group restarts Ray Train may make per run
ENV_PLACEMENT_TIMEOUT_S = "MOETUNE_PLACEMENT_TIMEOUT_S"  # how long a driver waits for Ray to place its workers
ENV_WEIGHTS_CACHE_DIR = "MOETUNE_WEIGHTS_CACHE_DIR"  # node-local cache of streamed weights ("" turns it off)
ENV_WEIGHTS_CACHE_MAX_GB = "MOETUNE_WEIGHTS_CACHE_MAX_GB"  # its size cap
ENV_METRICS_PORT = "MOETUNE_METRICS_PORT"  # workers' Prometheus port base (+ local rank), 0 = any, "off"
ENV_METRICS_TARGETS_DIR = "MOETUNE_METRICS_TARGETS_DIR"  # where workers announce themselves for file_sd
ENV_INJECT_FAULTS = "MOETUNE_INJECT_FAULTS"  # tests only: faults a worker raises on purpose (workers.loop.faults)
ENV_PERTURB_OP = "MOETUNE_TEST_PERTURB_OP"  # tests only: the operator the alignment check perturbs (its name)
# The driver's checks of the images inside the data files: the tenant's storage access (api.uri_access.UriAccess as
# JSON; unset: any URI, for a driver started by hand) and the operator's image limits (api.images.ImageLimits).
ENV_URI_ACCESS = "MOETUNE_URI_ACCESS"
ENV_IMAGE_LIMITS = "MOETUNE_IMAGE_LIMITS"

# Storage credentials and run-time switches the control plane copies into a job by default (its setting
# worker_env_passthrough can name others).
PASSTHROUGH_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
                   "HF_HUB_OFFLINE")
# What a driver hands every worker of its group, whatever the cluster's own environment holds.
WORKER_ENV = (ENV_CALLBACK_URL, ENV_JOB_TOKEN, ENV_S3_ENDPOINT_URL, *PASSTHROUGH_ENV, "AWS_REGION",
              ENV_METRICS_PORT, ENV_METRICS_TARGETS_DIR, ENV_INJECT_FAULTS, ENV_PERTURB_OP)
