"""Which storage URIs a tenant's job may read and write: schemes, buckets (and folders) per tenant.

Jobs name objects as `s3://bucket/key` and always reach them through the operator's one S3 endpoint
(MOETUNE_S3_ENDPOINT_URL): a URI cannot point the workers at another endpoint or host. `file://` reads the
workers' own disks, so it is refused unless the operator turns it on (MOETUNE_ALLOW_FILE_URIS), and then only under
the directories MOETUNE_FILE_URI_ROOTS lists. The same rules
cover the image URIs inside a job's data files (api/uri_access.py: the driver gets the tenant's access).
"""

from __future__ import annotations

from moetune.api.models.job_create import JobCreate
from moetune.api.uri_access import UriAccess
from moetune.service.errors import invalid_request
from moetune.service.settings import Settings

ANY_TENANT = "*"
_URI_FIELDS = ("model", "training_file", "validation_file", "output_uri")


def tenant_access(tenant: str, settings: Settings) -> UriAccess:
    prefixes = settings.uri_allow_list.get(tenant, []) + settings.uri_allow_list.get(ANY_TENANT, [])
    return UriAccess(prefixes=prefixes if settings.uri_allow_list else None, allow_file_uris=settings.allow_file_uris,
                     file_roots=settings.file_uri_roots if settings.allow_file_uris else None)


def check_job_uris(request: JobCreate, tenant: str, settings: Settings) -> None:
    """Raises a 422 naming the first URI field the tenant may not use."""
    access = tenant_access(tenant, settings)
    uris = [(field, getattr(request, field)) for field in _URI_FIELDS]
    if request.evaluation is not None:
        uris.append(("evaluation.file", request.evaluation.file))
    for field, uri in uris:
        if uri is not None and (problem := access.problem(uri)):
            raise invalid_request(f"{field}: {problem}", field)
