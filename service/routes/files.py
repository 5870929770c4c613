"""OpenAI's files API for fine-tuning data: `POST /v1/files` (multipart, purpose=fine-tune, or evaluation for an
`evaluation.file`), list, retrieve, delete
and download. The bytes go to the operator's bucket, one folder per tenant (Settings.files_uri); every row is
checked on upload by the rules the driver applies (api/data_rows.py, and the image URLs against the tenant's
storage access), so a bad file is refused with its row number before any job names it. An upload streams: its
rows are checked and written to storage (a multipart upload) as they arrive, in constant memory, and the first bad
row refuses it before the rest is read, leaving nothing stored. A job then names the
file by its id (`training_file: "file-..."`, `evaluation.file`), which create_job resolves to the stored URI."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import get_args

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from moetune.api import storage
from moetune.api.data_rows import RowError, evaluation_row_problem, row_problem
from moetune.api.errors import ErrorCode
from moetune.api.images import MB
from moetune.api.models.base import FILE_ID_PREFIX
from moetune.api.models.responses import FileDeleted, FileObject, FilePurpose, ListPage
from moetune.service.errors import APIException, invalid_request, documented_errors
from moetune.service.routes.deps import StoreDep, Tenant
from moetune.service.routes.multipart_stream import (MAX_FIELD_BYTES, Field, FileData, FileEnd, FileStart,
                                                     multipart_items)
from moetune.service.settings import Settings
from moetune.service.store import FileRow, Store
from moetune.service.submission.data_images import row_image_refusal
from moetune.service.submission.streamed_rows import NotUtf8, StreamedRows
from moetune.service.submission.uri_policy import tenant_access

router = APIRouter(prefix="/v1/files", tags=["files"], responses=documented_errors(
        (400, "The multipart body could not be parsed"),
        (401, "Missing or invalid API token"),
        (404, "No such file for this tenant"),
        (413, "The file is larger than the server's MOETUNE_MAX_UPLOAD_MB"),
        (422, "Not a valid fine-tuning file; `error.message` names the row"),
        (503, "The storage of uploaded files is not reachable"),
    ))

PIECE_BYTES = 2**20  # file bytes checked and written per hand-off to a worker thread
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"purpose": {"type": "string", "enum": list(get_args(FilePurpose))},
                   "file": {"type": "string", "format": "binary"}}}}}}}


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


def _too_large(settings: Settings) -> APIException:
    return APIException(413, ErrorCode.invalid_request,
                        f"file: larger than this server's limit of {settings.max_upload_mb:g} MB", "file")


def _view(row: FileRow) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=int(row.created_at), filename=row.filename,
                      purpose=row.purpose, rows=row.rows)


def _row_check(purpose: FilePurpose | None, tenant: str, settings: Settings) -> StreamedRows:
    """The rules of `purpose` (no model known yet: images are allowed; no metrics known yet: a regex reference is
    checked at submission); None (the file came before its purpose): only that it is UTF-8 JSONL."""
    if purpose is None:
        return StreamedRows(lambda row: None)
    access = tenant_access(tenant, settings)
    return StreamedRows(evaluation_row_problem if purpose == "evaluation" else row_problem,
                        lambda row: row_image_refusal(row, access, None))


class _StoredUpload:
    """One uploaded file on its way to storage, checked as it goes: a bad row stops it before the rest is read,
    and a refused or broken upload leaves nothing stored. Its methods block: call them from a worker thread."""

    def __init__(self, uri: str, filename: str, purpose: FilePurpose | None, tenant: str, settings: Settings):
        self.uri, self.filename, self.bytes = uri, filename, 0
        self._purpose, self._tenant, self._settings = purpose, tenant, settings
        self._rows = _row_check(purpose, tenant, settings)
        self._committed = False
        try:
            storage.make_bucket(uri, endpoint_url=settings.s3_endpoint_url)  # the operator's bucket may not exist yet
            self._write = storage.StagedWrite(uri, endpoint_url=settings.s3_endpoint_url)
        except OSError as e:
            raise _storage_down(e) from None

    def add(self, data: bytes) -> None:
        self.bytes += len(data)
        if self.bytes > self._settings.max_upload_mb * MB:
            raise _too_large(self._settings)
        with self._refusing_bad_rows():
            self._rows.feed(data)
        try:
            self._write.write(data)
        except OSError as e:
            raise _storage_down(e) from None

    def finish(self, purpose: FilePurpose) -> int:
        """Stores the file; its number of rows."""
        with self._refusing_bad_rows():
            rows = self._rows.finish()
        if not rows:
            raise invalid_request(f"file: {self.filename} holds no rows", "file")
        try:
            self._write.commit()
        except OSError as e:
            raise _storage_down(e) from None
        self._committed = True
        if self._purpose is None:  # the purpose came after the file: its rules read the stored copy
            rows = self._check_stored(_row_check(purpose, self._tenant, self._settings))
        return rows

    def discard(self) -> None:
        if self._committed:  # refused after the commit: _check_stored removed it
            return
        try:
            self._write.discard()
        except OSError:
            pass  # storage went away: an aborted multipart upload it did not hear of expires by the bucket's rules

    def _check_stored(self, rows: StreamedRows) -> int:
        fs, path = storage.filesystem(self.uri, self._settings.s3_endpoint_url)
        try:
            with self._refusing_bad_rows(), fs.open(path, "rb") as stored:
                while data := stored.read(PIECE_BYTES):
                    rows.feed(data)
                return rows.finish()
        except APIException:
            fs.rm_file(path)
            raise
        except OSError as e:
            raise _storage_down(e) from None

    @contextmanager
    def _refusing_bad_rows(self) -> Iterator[None]:
        try:
            yield
        except NotUtf8 as e:
            raise invalid_request(f"file: {self.filename} row {e.line} is not UTF-8 text", "file") from None
        except RowError as e:
            raise invalid_request(f"file: {self.filename} row {e.number}: {e.problem}", "file") from None


def _purpose(value: str) -> FilePurpose:
    if value not in get_args(FilePurpose):
        raise invalid_request(f"purpose: must be one of {', '.join(get_args(FilePurpose))}, not {value!r}", "purpose")
    return value


def _refuse_declared_size(request: Request, settings: Settings) -> None:
    """A body declared far larger than the limit is refused before any of it is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_upload_mb * MB + MAX_FIELD_BYTES:
        raise _too_large(settings)


@router.post("", response_model=FileObject, openapi_extra=UPLOAD_BODY)
async def upload_file(request: Request, tenant: Tenant, store: StoreDep) -> FileObject:
    """A multipart body with `purpose` and `file` (purpose first lets every row be checked as it arrives; after
    the file, the stored copy is read back once to check its rows)."""
    settings: Settings = request.app.state.settings
    _refuse_declared_size(request, settings)
    file_id = f"{FILE_ID_PREFIX}{secrets.token_hex(12)}"
    uri = storage.join(files_root(settings), tenant, f"{file_id}.jsonl")
    purpose: FilePurpose | None = None
    upload: _StoredUpload | None = None
    receiving, stored_rows = False, None
    pending = bytearray()  # file bytes not yet handed to the worker thread
    try:
        async for item in multipart_items(request):
            if isinstance(item, Field) and item.name == "purpose":
                purpose = _purpose(item.value)
            elif isinstance(item, FileStart) and item.name == "file":
                if upload is not None:
                    raise invalid_request("file: one file per upload", "file")
                upload = await run_in_threadpool(_StoredUpload, uri, item.filename or "upload.jsonl", purpose,
                                                 tenant, settings)
                receiving = True
            elif isinstance(item, FileData) and receiving:
                pending += item.data
                if len(pending) >= PIECE_BYTES:
                    await run_in_threadpool(upload.add, bytes(pending))
                    pending.clear()
            elif isinstance(item, FileEnd) and receiving:
                await run_in_threadpool(upload.add, bytes(pending))
                pending.clear()
                receiving = False
        if upload is None or receiving:
            raise invalid_request("file: required (a JSONL file part named 'file')", "file")
        if purpose is None:
            raise invalid_request(f"purpose: required (one of {', '.join(get_args(FilePurpose))})", "purpose")
        stored_rows = await run_in_threadpool(upload.finish, purpose)
    finally:
        if upload is not None and stored_rows is None:
            await run_in_threadpool(upload.discard)
    row = FileRow(id=file_id, tenant=tenant, filename=upload.filename, purpose=purpose, bytes=upload.bytes,
                  rows=stored_rows, uri=uri)
    return _view(await run_in_threadpool(store.add_file, row))


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
