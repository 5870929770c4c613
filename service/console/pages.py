"""The web console's routes. Every page is the same HTML shell naming its page; the module it loads
(static/console.js) calls the /v1 API with the token the person signed in with (kept in sessionStorage and sent as
the API's Bearer token), so a page shows exactly what the API shows that tenant and the shell itself holds no data.
The playground's chat goes through /console/serve/..., a same-origin pass-through to the Serve app
(MOETUNE_SERVE_URL): the page then needs no cross-origin access and no request of it leaves the control plane."""

from __future__ import annotations

from functools import partial
from importlib import resources

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from moetune.api.errors import ErrorCode
from moetune.service.auth import current_tenant
from moetune.service.cluster.serve_deploy import openai_base_url
from moetune.service.errors import APIException

router = APIRouter(prefix="/console", include_in_schema=False)

_STATIC = resources.files(__package__) / "static"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
PAGES = {"login": "Sign in", "jobs": "Jobs", "job": "Job", "report": "Adaptation report", "new": "New job",
         "compare": "Compare", "playground": "Playground"}
# Nothing outside the control plane: scripts, styles, fetches and frames all come from this origin (the report's
# frame is a srcdoc of the API's self-contained page, with scripts off).
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": _CSP, "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "same-origin"}


def _shell(page: str) -> HTMLResponse:
    html = (_STATIC / "shell.html").read_text().replace("{page}", page).replace("{title}", PAGES[page])
    return HTMLResponse(html, headers=_HEADERS)


# Each page's path; a job's id is read by the page from its URL, never written into the HTML.
_ROUTES = (("", "jobs"), ("/login", "login"), ("/jobs", "jobs"), ("/jobs/{job_id}", "job"),
           ("/jobs/{job_id}/report", "report"), ("/new", "new"), ("/compare", "compare"),
           ("/playground", "playground"))
for _path, _page in _ROUTES:
    router.add_api_route(_path, partial(_shell, _page), methods=["GET"], response_class=HTMLResponse)


@router.get("/static/{name}")
def static(name: str) -> Response:
    suffix = name[name.rfind("."):] if "." in name else ""
    path = _STATIC / name
    if "/" in name or suffix not in _TYPES or not path.is_file():
        raise APIException(404, ErrorCode.not_found, f"No console file {name!r}.")
    return Response(path.read_bytes(), media_type=_TYPES[suffix], headers={"Cache-Control": "no-cache"})


@router.post("/serve/chat/completions", dependencies=[Depends(current_tenant)])
async def chat(request: Request) -> Response:
    """The caller's body and token (a known one: no relay for strangers), sent on to the Serve app's OpenAI route;
    its answer, streamed or not, comes back as it is. The Serve app resolves the model for the token's tenant."""
    url = openai_base_url(request.app.state.settings.serve_url) + "/chat/completions"
    client = httpx.AsyncClient(timeout=httpx.Timeout(300, connect=5))
    upstream = client.build_request("POST", url, content=await request.body(), headers={
        "Authorization": request.headers.get("authorization", ""), "Content-Type": "application/json"})
    try:
        answer = await client.send(upstream, stream=True)
    except httpx.HTTPError as e:
        await client.aclose()
        raise APIException(503, ErrorCode.serve_unavailable, f"The Serve app at {url} does not answer ({type(e).__name__}): "
                                                     "deploy a succeeded job first (its page's Deploy button).") from None

    async def close() -> None:
        await answer.aclose()
        await client.aclose()

    return StreamingResponse(answer.aiter_bytes(), status_code=answer.status_code, background=BackgroundTask(close),
                             media_type=answer.headers.get("content-type", "application/json"))
