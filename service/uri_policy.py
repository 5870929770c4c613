"""Which storage URIs a tenant's job may read and write: schemes, buckets (and folders) per tenant.

Jobs name objects as `s3://bucket/key` and always reach them through the operator's one S3 endpoint
(MOETUNE_S3_ENDPOINT_URL): a URI cannot point the workers at another endpoint or host. `file://` reads the
workers' own disks, so it is refused unless the operator turns it on (MOETUNE_ALLOW_FILE_URIS).
"""

from __future__ import annotations

from moetune.api.models import JobCreate
from moetune.service.errors import invalid_request
from moetune.service.settings import Settings

ANY_TENANT = "*"
_URI_FIELDS = ("model", "training_file", "validation_file", "output_uri")


def _within(uri: str, prefix: str) -> bool:
    """Prefix match on whole path segments: `s3://data` covers `s3://data/x`, not `s3://data-b/x`."""
    prefix = prefix.rstrip("/")
    return uri == prefix or uri.startswith(prefix + "/")


def check_job_uris(request: JobCreate, tenant: str, settings: Settings) -> None:
    """Raises a 422 naming the first URI field the tenant may not use."""
    allowed = settings.uri_allow_list.get(tenant, []) + settings.uri_allow_list.get(ANY_TENANT, [])
    for field in _URI_FIELDS:
        uri = getattr(request, field)
        if uri is None:
            continue
        if uri.startswith("file://") and not settings.allow_file_uris:
            raise invalid_request(f"{field}: file:// URIs are disabled on this server; use s3://", field)
        if ".." in uri.split("/"):
            raise invalid_request(f"{field}: '..' path segments are not allowed", field)
        if settings.uri_allow_list and not any(_within(uri, prefix) for prefix in allowed):
            raise invalid_request(f"{field}: {uri} is outside this tenant's storage locations "
                                  f"({', '.join(allowed) or 'none'})", field)
