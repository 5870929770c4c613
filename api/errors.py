"""Every error code moetune sends (`ErrorInfo.code`, `{"error": {"code", ...}}`), in one place.

`ErrorInfo.code` stays a plain string on the wire: an ErrorCode is a StrEnum, so it serialises as its value
and compares equal to it (`ErrorCode.job_not_found == "job_not_found"`); clients need not know this enum.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # ---- answers of the HTTP API (control plane) and the SDK
    invalid_request = "invalid_request"  # 422: a request (or a job spec) that fails validation
    invalid_api_key = "invalid_api_key"  # 401: missing or unknown API token
    invalid_job_token = "invalid_job_token"  # 401: a worker report without its job's token
    job_not_found = "job_not_found"  # 404
    not_found = "not_found"  # 404 for any other path
    report_not_found = "report_not_found"  # 404: the job has no adaptation report (yet: written on success)
    method_not_allowed = "method_not_allowed"  # 405
    http_error = "http_error"  # any other HTTP error; the SDK's code for a non-JSON error answer
    idempotency_key_reused = "idempotency_key_reused"  # 409: same Idempotency-Key, different body
    job_not_cancellable = "job_not_cancellable"  # 409
    job_not_pausable = "job_not_pausable"  # 409
    job_not_resumable = "job_not_resumable"  # 409
    checkpoint_incomplete = "checkpoint_incomplete"  # 409: a checkpoint report before its manifest exists
    quota_exceeded = "quota_exceeded"  # 429: the tenant's GPU-hour budget (tenant_quotas) is spent
    job_ended = "job_ended"  # 409: a worker report for a job that already succeeded, failed or was cancelled
    not_ready = "not_ready"  # 503 from /readyz: a dependency (database, Ray, storage) is not reachable
    storage_unavailable = "storage_unavailable"  # 503: the object storage did not answer (uploads, downloads)
    internal_error = "internal_error"  # 500

    # ---- serving (control plane's /v1/models and deploy, the Serve app's OpenAI routes)
    # model_not_found (404) is the code of an unknown model, another tenant's included
    job_not_deployable = "job_not_deployable"  # 409: only a succeeded job has a model to serve
    serve_unavailable = "serve_unavailable"  # 503: Ray Serve did not accept the application
    context_length_exceeded = "context_length_exceeded"  # 400: the prompt (+ max_tokens) exceeds the context
    adapter_unavailable = "adapter_unavailable"  # 503: the replica cannot load the adapter (the cause follows)

    # ---- a failed job's error (Job.error), set by the control plane
    file_not_found = "file_not_found"  # an input URI does not exist (checked before queueing)
    file_not_accessible = "file_not_accessible"  # access to an input URI was denied
    driver_failed = "driver_failed"  # the Ray job failed or exited without a result
    ray_job_lost = "ray_job_lost"  # Ray no longer knows the job's submission
    unschedulable = "unschedulable"  # no node (or not all of them together) has the resources the workers need

    # ---- a failed job's error, reported by the workers (ResultReport.error)
    model_not_found = "model_not_found"  # no config.json under the model URI
    invalid_model = "invalid_model"  # config.json or tokenizer unusable
    unsupported_model = "unsupported_model"  # a model_type no family supports
    invalid_model_weights = "invalid_model_weights"  # shards missing, mismatched or unreadable
    invalid_target_modules = "invalid_target_modules"  # lora.target_modules names no linear module
    unsupported_chat_template = "unsupported_chat_template"  # assistant turns cannot be located for masking
    invalid_training_file = "invalid_training_file"  # the training file is missing, unreadable or malformed
    invalid_validation_file = "invalid_validation_file"  # the same for the validation file
    invalid_evaluation_file = "invalid_evaluation_file"  # the same for evaluation.file
    alignment_failed = "alignment_failed"  # a swapped operator differs from its reference (alignment_check)
    training_failed = "training_failed"  # any other training failure (also a failed result without an error)

    # ---- training sessions (/v1/training_sessions): answers, and a call's or a session's error
    session_not_open = "session_not_open"  # 409: the session is closing, closed or failed (a call not run says so)
    session_restarted = "session_restarted"  # a call the worker group was running when it was restarted
    session_failed = "session_failed"  # the session's worker group failed (the cause follows)

    @classmethod
    def invalid_file(cls, param: str) -> ErrorCode:
        """The code of a data file that cannot be used: `param` is "training_file", "validation_file" or
        "evaluation.file"."""
        return cls(f"invalid_{param.replace('.', '_')}")
