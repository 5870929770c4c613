"""The Python SDK: a typed httpx client for the moetune control plane.

    client = Client("http://127.0.0.1:8000", token="dev-token")
    job = client.jobs.create({"model": "s3://models/m", "training_file": "s3://data/train.jsonl"})
    job = client.jobs.wait(job.id, timeout=3600, on_event=print)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from pydantic import BaseModel

from moetune.api.errors import ErrorCode
from moetune.api.models.job_create import JobCreate
from moetune.api.models.responses import Checkpoint, FileDeleted, FileObject, Job, JobEvent, JobStatus, ListPage
from moetune.api.models.webhooks import WebhookEndpoint, WebhookEndpointDeleted, WebhookEndpointWithSecret
from moetune.api.report import AdaptationReport
from moetune.api.serving import Deployment, ModelList, ModelObject

JOBS_PATH = "/v1/fine_tuning/jobs"
FILES_PATH = "/v1/files"
MODELS_PATH = "/v1/models"
WEBHOOKS_PATH = "/v1/webhook_endpoints"


class APIError(Exception):
    """An error answer of the control plane (`{"error": {"code", "message", "param"}}`)."""

    def __init__(self, status_code: int, code: str, message: str, param: str | None = None):
        super().__init__(f"{status_code} {code}: {message}" + (f" (param: {param})" if param else ""))
        self.status_code, self.code, self.message, self.param = status_code, code, message, param

    @classmethod
    def from_response(cls, response: httpx.Response) -> APIError:
        try:
            error = response.json()["error"]
            return cls(response.status_code, error["code"], error["message"], error.get("param"))
        except (ValueError, KeyError, TypeError):
            return cls(response.status_code, ErrorCode.http_error, response.text[:500] or response.reason_phrase)


def _raise_for_error(response: httpx.Response) -> None:
    if response.is_error:
        response.read()  # streamed responses have not read their body yet
        raise APIError.from_response(response)


def _send(http: httpx.Client, method: str, path: str, stream: bool = False, **kwargs) -> httpx.Response:
    """One request; an idempotent one is sent once more when the server closed the pooled connection it went out
    on without answering (the keep-alive race: the server's idle timeout ends just as the client reuses it)."""
    request = http.build_request(method, path, **kwargs)
    try:
        return http.send(request, stream=stream)
    except httpx.RemoteProtocolError:
        if method not in ("GET", "HEAD", "DELETE"):
            raise
        return http.send(request, stream=stream)


def _typed(http: httpx.Client, method: str, path: str, model: type[BaseModel], **kwargs) -> Any:
    """The answer as `model`; APIError for an error answer."""
    response = _send(http, method, path, **kwargs)
    _raise_for_error(response)
    return model.model_validate(response.json())


def _sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event name, data) per Server-Sent Event; comments and ids are consumed."""
    name, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)


class Jobs:
    def __init__(self, http: httpx.Client):
        self._http = http

    def _request(self, method: str, path: str, model: type[BaseModel], **kwargs) -> Any:
        return _typed(self._http, method, path, model, **kwargs)

    def create(self, spec: JobCreate | dict, idempotency_key: str | None = None) -> Job:
        """Submits a job. With `idempotency_key`, repeating the same request returns the same job."""
        spec = spec if isinstance(spec, JobCreate) else JobCreate.model_validate(spec)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._request("POST", JOBS_PATH, Job, headers=headers,
                             json=spec.model_dump(mode="json", exclude_unset=True))

    def list(self, after: str | None = None, limit: int = 20) -> ListPage[Job]:
        """Newest first; pass the page's `last_id` as `after` for the next page."""
        return self._request("GET", JOBS_PATH, ListPage[Job], params=_params(after=after, limit=limit))

    def retrieve(self, job_id: str) -> Job:
        return self._request("GET", f"{JOBS_PATH}/{job_id}", Job)

    def cancel(self, job_id: str) -> Job:
        return self._request("POST", f"{JOBS_PATH}/{job_id}/cancel", Job)

    def deploy(self, job_id: str) -> Deployment:
        """Serves the succeeded job's model (the Serve app on the Ray cluster); its name and the OpenAI base URL."""
        return self._request("POST", f"{JOBS_PATH}/{job_id}/deploy", Deployment, timeout=180)

    def pause(self, job_id: str) -> Job:
        """A running job turns `pausing`, then `paused` once its workers checkpointed and stopped."""
        return self._request("POST", f"{JOBS_PATH}/{job_id}/pause", Job)

    def resume(self, job_id: str) -> Job:
        """A paused job is queued again and continues from its last checkpoint."""
        return self._request("POST", f"{JOBS_PATH}/{job_id}/resume", Job)

    def events(self, job_id: str, after: str | None = None, limit: int = 20) -> ListPage[JobEvent]:
        """Newest first (as OpenAI's); pass the page's `last_id` as `after` for the next, older page."""
        return self._request("GET", f"{JOBS_PATH}/{job_id}/events", ListPage[JobEvent],
                             params=_params(after=after, limit=limit))

    def checkpoints(self, job_id: str, after: str | None = None, limit: int = 10) -> ListPage[Checkpoint]:
        """Newest first."""
        return self._request("GET", f"{JOBS_PATH}/{job_id}/checkpoints", ListPage[Checkpoint],
                             params=_params(after=after, limit=limit))

    def report(self, job_id: str) -> AdaptationReport:
        """The adaptation report of a job that succeeded (api.report)."""
        return self._request("GET", f"{JOBS_PATH}/{job_id}/report", AdaptationReport)

    def report_html(self, job_id: str) -> str:
        """The same report as one self-contained HTML page."""
        response = _send(self._http, "GET", f"{JOBS_PATH}/{job_id}/report.html")
        _raise_for_error(response)
        return response.text

    def stream_events(self, job_id: str, after: str | None = None,
                      read_timeout: float | None = 60.0) -> Iterator[JobEvent]:
        """The job's events live (Server-Sent Events), from after `after`; ends once the job has ended.

        The server sends keep-alive comments, so `read_timeout` only trips on a dead connection.
        """
        timeout = httpx.Timeout(self._http.timeout.connect, read=read_timeout)
        response = _send(self._http, "GET", f"{JOBS_PATH}/{job_id}/events", stream=True, timeout=timeout,
                         params=_params(stream="true", after=after), headers={"Accept": "text/event-stream"})
        try:
            _raise_for_error(response)
            for name, data in _sse_events(response.iter_lines()):
                if name == "done":
                    return
                yield JobEvent.model_validate_json(data)
        finally:
            response.close()

    def wait(self, job_id: str, timeout: float, poll_interval: float = 2.0,
             on_event: Callable[[JobEvent], None] | None = None) -> Job:
        """Follows the job until it ends, calling `on_event` for each event; returns the final job.

        Raises TimeoutError when the job has not ended after `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        seen = None
        while True:
            job = self.retrieve(job_id)  # status first: once it is terminal, its last event is in the list below
            for event in self.events_since(job_id, seen):
                if on_event is not None:
                    on_event(event)
                seen = event.id
            if JobStatus(job.status).terminal:
                return job
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout:.0f}s")
            time.sleep(min(poll_interval, max(deadline - time.monotonic(), 0)))

    def events_since(self, job_id: str, seen: str | None = None) -> list[JobEvent]:
        """The events newer than event `seen` (all of them when None), oldest first: pages of the newest-first
        list, read until `seen` comes up."""
        newer, after = [], None
        while True:
            page = self.events(job_id, after=after, limit=100)
            for event in page.data:
                if event.id == seen:
                    return newer[::-1]
                newer.append(event)
            if not page.has_more:
                return newer[::-1]
            after = page.last_id


class Files:
    """Uploaded data files (OpenAI's files API): a job names one by its id as training_file / validation_file."""

    def __init__(self, http: httpx.Client):
        self._http = http

    def create(self, data: bytes, filename: str, purpose: str = "fine-tune") -> FileObject:
        """Uploads JSONL rows; the server checks every row and answers 422 naming the first bad one."""
        return _typed(self._http, "POST", FILES_PATH, FileObject, files={"file": (filename, data)},
                          data={"purpose": purpose})

    def list(self, after: str | None = None, limit: int = 100) -> ListPage[FileObject]:
        return _typed(self._http, "GET", FILES_PATH, ListPage[FileObject], params=_params(after=after, limit=limit))

    def retrieve(self, file_id: str) -> FileObject:
        return _typed(self._http, "GET", f"{FILES_PATH}/{file_id}", FileObject)

    def content(self, file_id: str) -> bytes:
        response = _send(self._http, "GET", f"{FILES_PATH}/{file_id}/content")
        _raise_for_error(response)
        return response.content

    def delete(self, file_id: str) -> FileDeleted:
        return _typed(self._http, "DELETE", f"{FILES_PATH}/{file_id}", FileDeleted)


class Models:
    """OpenAI's models of the caller's tenant: the shared bases and its fine-tuned models."""

    def __init__(self, http: httpx.Client):
        self._http = http

    def list(self) -> ModelList:
        return _typed(self._http, "GET", MODELS_PATH, ModelList)

    def retrieve(self, model: str) -> ModelObject:
        """With `moetune`: the base's URI and the adapter's (None for a base)."""
        return _typed(self._http, "GET", f"{MODELS_PATH}/{model}", ModelObject)


class Webhooks:
    """The tenant's webhook endpoints: job events are POSTed to them, signed the Standard Webhooks way (verify
    with the `openai` SDK's `client.webhooks.unwrap(body, headers, secret=endpoint.signing_secret)`)."""

    def __init__(self, http: httpx.Client):
        self._http = http

    def create(self, url: str, event_types: list[str] | None = None,
               name: str | None = None) -> WebhookEndpointWithSecret:
        """Every event unless `event_types` names some; the answer is the only one holding the signing secret."""
        return _typed(self._http, "POST", WEBHOOKS_PATH, WebhookEndpointWithSecret,
                      json=_params(url=url, event_types=event_types, name=name))

    def list(self, after: str | None = None, limit: int = 20) -> ListPage[WebhookEndpoint]:
        return _typed(self._http, "GET", WEBHOOKS_PATH, ListPage[WebhookEndpoint],
                      params=_params(after=after, limit=limit))

    def retrieve(self, endpoint_id: str) -> WebhookEndpoint:
        return _typed(self._http, "GET", f"{WEBHOOKS_PATH}/{endpoint_id}", WebhookEndpoint)

    def delete(self, endpoint_id: str) -> WebhookEndpointDeleted:
        return _typed(self._http, "DELETE", f"{WEBHOOKS_PATH}/{endpoint_id}", WebhookEndpointDeleted)


def _params(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class Client:
    def __init__(self, base_url: str, token: str, timeout: float = 30.0):
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout,
                                  headers={"Authorization": f"Bearer {token}"})
        self.jobs = Jobs(self._http)
        self.files = Files(self._http)
        self.models = Models(self._http)
        self.webhooks = Webhooks(self._http)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
