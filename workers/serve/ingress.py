"""The OpenAIServer ingress (FastAPI) in front of the BaseModelServer deployments: authenticates, validates and
streams. It imports no torch (nor does the app's builder): only the engine replicas load the model stack.

No `from __future__ import annotations` here: Serve rebuilds the routes in the replica, where string annotations
(`request: "Request"`) no longer resolve and FastAPI would take `request` for a query parameter."""

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from ray import serve

from moetune.api.errors import ErrorCode
from moetune.workers.serve.metrics import ServeMetrics
from moetune.workers.serve.resolver import ModelResolver, Refusal
from moetune.workers.serve.responses import CHAT, TEXT, Answer, Shape
from moetune.workers.serve.schema import ChatCompletionRequest, CompletionRequest


api = FastAPI(title="moetune serve", summary="OpenAI-compatible inference of moetune's base and tuned models")


def _error(status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "param": param}}, status_code=status)


def _field_path(error: ValidationError) -> str:
    first = error.errors()[0]
    return ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and p in ("str", "list[TextPart]")))


@serve.deployment
@serve.ingress(api)
class OpenAIServer:
    def __init__(self, engines: dict, control_plane_url: str):
        self.engines = engines  # base URI -> BaseModelServer handle
        self.resolver = ModelResolver(control_plane_url)
        self.metrics = ServeMetrics()

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, ChatCompletionRequest, CHAT)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._complete(request, CompletionRequest, TEXT)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        status, body = await self.resolver.list(request.headers.get("authorization", ""))
        return JSONResponse(body, status_code=status)

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        stats = {uri: await handle.stats.remote() for uri, handle in self.engines.items()}
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    async def _complete(self, request: Request, schema, shape: Shape) -> Response:
        response = await self._answer(request, schema, shape)
        self.metrics.requests.labels(shape.object, str(response.status_code)).inc()
        return response

    async def _answer(self, request: Request, schema, shape: Shape) -> Response:
        started = time.perf_counter()
        try:
            body = schema.model_validate(await request.json())
        except ValueError as e:  # not JSON, or a field out of range (pydantic's ValidationError is a ValueError)
            if not isinstance(e, ValidationError):
                return _error(400, ErrorCode.invalid_request, "The request body is not valid JSON.")
            param = _field_path(e)
            return _error(400, ErrorCode.invalid_request, f"{param}: {e.errors()[0]['msg']}", param)
        found = await self.resolver.resolve(request.headers.get("authorization", ""), body.model)
        if isinstance(found, Refusal):
            return JSONResponse(found.body, status_code=found.status)
        served = found.moetune
        engine = self.engines.get(served.base_model_uri) if served else None
        if engine is None:
            return _error(404, ErrorCode.model_not_found, f"The base model {served.base_model!r} is not deployed on "
                          "this server (POST /v1/fine_tuning/jobs/{id}/deploy deploys a job's base).", "model")
        job = {"adapter_uri": served.adapter_uri, "max_tokens": body.token_budget(), "temperature": body.temperature,
               "top_p": body.top_p, "n": body.n, "stop": body.stop_strings(), "seed": body.seed}
        if shape.chat:
            job["messages"] = [{"role": m.role, "content": m.text()} for m in body.messages]
        else:
            job["prompt"] = body.prompt
        events = engine.options(stream=True).generate.remote(job).__aiter__()
        first = await anext(events)
        if "error" in first:
            return _error(**first["error"])
        answer = Answer(shape, body.model, body.n, first["prompt_tokens"])
        head = await anext(events)  # the first token, or the adapter's load error, before any status is sent
        if "error" in head:
            return _error(**head["error"])
        self.metrics.ttft.labels(served.base_model).observe(time.perf_counter() - started)
        if not body.stream:
            answer.add(head)
            async for event in events:
                if "error" in event:
                    return _error(**event["error"])
                answer.add(event)
            self.metrics.tokens.labels(served.base_model).inc(answer.completion_tokens)
            return JSONResponse(answer.body())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def sse():
            yield "".join(answer.opening_chunks())
            yield answer.chunk(head)
            async for event in events:
                if "error" in event:
                    yield answer.error_chunk(event["error"])
                    return
                yield answer.chunk(event)
            self.metrics.tokens.labels(served.base_model).inc(answer.completion_tokens)
            yield "".join(answer.closing_chunks(include_usage))

        return StreamingResponse(sse(), media_type="text/event-stream")

