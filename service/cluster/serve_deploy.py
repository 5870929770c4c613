"""Deploys the OpenAI-compatible Serve application (workers/serve) through Ray's Serve REST API.

The REST API on the Ray dashboard (the same address as the Jobs API) takes a declarative config naming the app's
builder by import path, so neither the control plane nor the CLI imports Ray, torch or the engine: the Serve
controller imports `moetune.workers.serve.app` in the cluster. The app serves one engine deployment per base;
deploying a job's base adds it to those already served (a PUT replaces the whole config, so the current bases are
read back first).
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import httpx

from moetune.api.errors import ErrorCode
from moetune.service.api_exception import APIException

APP_NAME = "moetune-serve"
APP_BUILDER = "moetune.workers.serve.app:build_app"
_APPS_PATH = "/api/serve/applications/"
_READ_ATTEMPTS = 3
FAILED_STATUSES = ("DEPLOY_FAILED", "UNHEALTHY")  # an application's, in Serve's answer


def openai_base_url(serve_url: str) -> str:
    """What `openai.OpenAI(base_url=...)` takes."""
    return serve_url.rstrip("/") + "/v1"


def _unavailable(message: str) -> APIException:
    return APIException(503, ErrorCode.serve_unavailable, message)


def failure_message(app: dict) -> str:
    """Why Serve's answer for one application says it is not serving: the `message` of each deployment that is
    not HEALTHY (where Ray puts a replica constructor's exception, e.g. a base too big for one device), else the
    application's own; "" when there is none. A message that ends in a traceback keeps its first line (Ray's
    account) and its last (the exception): the frames stay on the Ray dashboard."""
    failing = [f"{name}: {_first_and_last_lines(details['message'])}"
               for name, details in (app.get("deployments") or {}).items()
               if details.get("status") not in (None, "HEALTHY") and details.get("message")]
    return "\n".join(failing) or app.get("message") or ""


def _first_and_last_lines(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


def _serve_instance(ray_address: str) -> dict:
    """Serve's account of itself on the cluster (its HTTP options, proxies and applications).

    The read is retried when a connection was made but dropped: a busy dashboard sometimes closes one without
    answering (seen on a loaded 2-core machine: `moetune demo` failed on one such GET right after its job)."""
    for attempt in range(1, _READ_ATTEMPTS + 1):
        try:
            answer = httpx.get(ray_address.rstrip("/") + _APPS_PATH, timeout=30)
            break
        except httpx.HTTPError as exc:
            if attempt == _READ_ATTEMPTS or isinstance(exc, httpx.ConnectError):
                raise _unavailable(f"The Ray dashboard at {ray_address} did not answer: {exc}") from exc
            time.sleep(attempt)
    if answer.status_code != 200:
        raise _unavailable(f"Ray Serve answered {answer.status_code}: {answer.text[:500]}")
    return answer.json()


def current_app(ray_address: str, instance: dict | None = None) -> dict | None:
    """The deployed config, status and failure message of moetune's Serve app ({"args", "status", "message"}),
    None if none is deployed (`instance`: Serve's answer when the caller has it)."""
    app = ((instance or _serve_instance(ray_address)).get("applications") or {}).get(APP_NAME)
    if not app:
        return None
    return {"args": (app.get("deployed_app_config") or {}).get("args") or {}, "status": app.get("status", ""),
            "message": failure_message(app)}


def _check_proxy_port(instance: dict, serve_url: str) -> None:
    """Serve keeps the HTTP port it started with (a later config's is ignored): a running Serve that listens
    elsewhere than `serve_url` would leave every client told that URL connecting to nothing."""
    running = (instance.get("http_options") or {}).get("port") if instance.get("controller_info") else None
    wanted = urlsplit(serve_url).port or 80
    if running is not None and running != wanted:
        raise _unavailable(f"Ray Serve on this cluster listens on port {running}, not on the port of the control "
                           f"plane's serve_url {serve_url} (Serve keeps the port it first started with): set "
                           f"MOETUNE_SERVE_URL to that port, or shut Serve down (`serve shutdown`) and deploy again")


def deploy(ray_address: str, serve_url: str, control_plane_url: str, bases: dict[str, str],
           s3_endpoint_url: str | None = None) -> str:
    """Ensures the app serves `bases` ({name: uri}) besides what it serves already; returns the app's status."""
    instance = _serve_instance(ray_address)
    _check_proxy_port(instance, serve_url)
    current = current_app(ray_address, instance)
    served = dict(current["args"].get("bases", {})) if current else {}
    wanted = {**served, **bases}
    args = {"control_plane_url": control_plane_url, "bases": wanted, "s3_endpoint_url": s3_endpoint_url}
    if current and current["args"] == args:
        if current["status"] in FAILED_STATUSES:  # the same config again changes nothing: say why it fails
            raise _unavailable(f"The Serve app is {current['status']}: "
                               f"{current['message'] or 'see the Ray dashboard (Serve page)'}")
        return current["status"]
    where = urlsplit(serve_url)
    config = {
        # the proxy listens where clients are told to connect (serve_url's port): on loopback for a loopback URL
        # (the embedded stack), else on every interface of the head node
        "http_options": {"host": "127.0.0.1" if where.hostname in ("127.0.0.1", "localhost") else "0.0.0.0",
                         "port": where.port or 80},
        "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": APP_BUILDER, "args": args}],
    }
    try:
        answer = httpx.put(ray_address.rstrip("/") + _APPS_PATH, json=config, timeout=60)
    except httpx.HTTPError as exc:
        raise _unavailable(f"The Ray dashboard at {ray_address} did not answer: {exc}") from exc
    if answer.status_code != 200:
        raise _unavailable(f"Ray Serve refused the application ({answer.status_code}): {answer.text[:500]}")
    return "DEPLOYING"
