"""OpenAI's files API for fine-tuning data: `POST /v1/files` (multipart, purpose=fine-tune, or evaluation for an
`evaluation.file`), list, retrieve, delete
and download. The bytes go to the operator's bucket, one folder per tenant (Settings.files_uri); every row is
checked on upload by the rules the driver applies (api/data_rows.py, and the image URLs against the tenant's
storage access), so a bad file is refused with its row number before any job names it. A job then names the
file by its id (`training_file: "file-..."`, `evaluation.file`), which create_job resolves to the stored URI."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response

from moetune.api import storage
from moetune.api.data_rows import RowError, evaluation_row_problem, parse_rows, row_problem
from moetune.api.errors import ErrorCode
from moetune.api.images import MB
from moetune.api.models.base import FILE_ID_PREFIX
from moetune.api.models.responses import FileDeleted, FileObject, FilePurpose, ListPage
from moetune.service.errors import APIException, invalid_request, documented_errors
from moetune.service.routes.deps import StoreDep, Tenant
from moetune.service.settings import Settings
from moetune.service.store import FileRow, Store
from moetune.service.submission.data_images import row_image_refusal
from moetune.service.submission.uri_policy import tenant_access

router = APIRouter(prefix="/v1/files", tags=["files"], responses=documented_errors(
        (400, "The multipart body could not be parsed"),
        (401, "Missing or invalid API token"),
        (404, "No such file for this tenant"),
        (413, "The file is larger than the server's MOETUNE_MAX_UPLOAD_MB"),
        (422, "Not a valid fine-tuning file; `error.message` names the row"),
        (503, "The storage of uploaded files is not reachable"),
    ))


def files_root(settings: Settings) -> str:
    """The folder of uploaded files: the setting, else `files/` in the bucket of the default output location."""
    if settings.files_uri:
        return settings.files_uri.rstrip("/")
    scheme, rest = settings.default_output_uri.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}/files"


def file_not_found(file_id: str, param: str | None = None) -> APIException:
    return APIException(404, ErrorCode.file_not_found, f"No file with id {file_id!r}.", param)


def _storage_down(e: Exception) -> APIException:
    return APIException(503, ErrorCode.storage_unavailable, f"The storage of uploaded files is not reachable ({e}).")


def _view(row: FileRow) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=int(row.created_at), filename=row.filename,
                      purpose=row.purpose, rows=row.rows)


def _checked_rows(data: bytes, filename: str, purpose: FilePurpose, tenant: str, settings: Settings) -> int:
    """How many rows the file holds; a 422 naming the first bad row by the rules of its purpose (no model known
    yet: images are allowed; no metrics known yet: a regex reference is checked at submission)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_request(f"file: {filename} is not UTF-8 text", "file") from None
    access = tenant_access(tenant, settings)
    try:
        rows = parse_rows(text, lambda row: row_image_refusal(row, access, None),
                          evaluation_row_problem if purpose == "evaluation" else row_problem)
    except RowError as e:
        raise invalid_request(f"file: {filename} row {e.number}: {e.problem}", "file") from None
    if not rows:
        raise invalid_request(f"file: {filename} holds no rows", "file")
    return len(rows)


def _write(uri: str, data: bytes, settings: Settings) -> None:
    try:
        try:
            storage.write_bytes(uri, data, endpoint_url=settings.s3_endpoint_url)
        except FileNotFoundError:  # the operator's bucket does not exist yet
            storage.make_bucket(uri, endpoint_url=settings.s3_endpoint_url)
            storage.write_bytes(uri, data, endpoint_url=settings.s3_endpoint_url)
    except OSError as e:
        raise _storage_down(e) from None


@router.post("", response_model=FileObject)
def upload_file(request: Request, tenant: Tenant, store: StoreDep, file: Annotated[UploadFile, File()],
                purpose: Annotated[FilePurpose, Form()]) -> FileObject:
    settings: Settings = request.app.state.settings
    limit = int(settings.max_upload_mb * MB)
    data = file.file.read(limit + 1)
    if len(data) > limit:
        raise APIException(413, ErrorCode.invalid_request,
                           f"file: larger than this server's limit of {settings.max_upload_mb:g} MB", "file")
    filename = file.filename or "upload.jsonl"
    rows = _checked_rows(data, filename, purpose, tenant, settings)
    file_id = f"{FILE_ID_PREFIX}{secrets.token_hex(12)}"
    uri = storage.join(files_root(settings), tenant, f"{file_id}.jsonl")
    _write(uri, data, settings)
    return _view(store.add_file(FileRow(id=file_id, tenant=tenant, filename=filename, purpose=purpose,
                                        bytes=len(data), rows=rows, uri=uri)))


def own_file(store: Store, tenant: str, file_id: str, param: str | None = None) -> FileRow:
    """The tenant's file; another tenant's file is exactly as unknown as a missing one."""
    file = store.get_file(file_id, tenant)
    if file is None:
        raise file_not_found(file_id, param)
    return file


@router.get("", response_model=ListPage[FileObject])
def list_files(tenant: Tenant, store: StoreDep, after: str | None = None, limit: int = 100,
               purpose: FilePurpose | None = None) -> ListPage[FileObject]:
    """Newest first; pass the page's `last_id` as `after` for the next page."""
    cursor = own_file(store, tenant, after, "after") if after else None
    rows, has_more = store.list_files(tenant, max(1, min(limit, 10_000)), cursor, purpose)
    data = [_view(r) for r in rows]
    return ListPage(data=data, has_more=has_more, first_id=data[0].id if data else None,
                    last_id=data[-1].id if data else None)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, tenant: Tenant, store: StoreDep) -> FileObject:
    return _view(own_file(store, tenant, file_id))


@router.get("/{file_id}/content", response_class=Response,
            responses={200: {"content": {"application/jsonl": {}}, "description": "The file's bytes"}})
def file_content(file_id: str, request: Request, tenant: Tenant, store: StoreDep) -> Response:
    file = own_file(store, tenant, file_id)
    try:
        data = storage.read_bytes(file.uri, endpoint_url=request.app.state.settings.s3_endpoint_url)
    except OSError as e:
        raise _storage_down(e) from None
    return Response(data, media_type="application/jsonl")


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, request: Request, tenant: Tenant, store: StoreDep) -> FileDeleted:
    """Removes the object too: a job that has not started reading it fails its file check like any missing input."""
    file = own_file(store, tenant, file_id)
    try:
        fs, path = storage.filesystem(file.uri, request.app.state.settings.s3_endpoint_url)
        fs.rm_file(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise _storage_down(e) from None
    store.delete_file(file.id)
    return FileDeleted(id=file.id, deleted=True)
