"""Tinker's HTTP protocol (the `tinker` SDK's /api/v1 routes) on moetune's training sessions: a Tinker model is a
training session, its calls are the session's calls, its futures are their outcomes. Mounted under /tinker:
`TINKER_BASE_URL=http://<control plane>/tinker`.

Every call answers {request_id} at once; the SDK then long-polls retrieve_future, which answers `try_again` while
the call runs. The SDK resends a request it got no answer to (same X-Idempotency-Key, or for training calls the
same seq_id): the copy gets the first one's future and nothing runs twice."""

from __future__ import annotations

import re
from typing import Any, get_args

from fastapi import APIRouter, Depends, Header, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from moetune.api.errors import ErrorCode
from moetune.api.models.lora import LoraSpec
from moetune.api.models.training_sessions import (
    CallArgs,
    Forward,
    ForwardBackward,
    LoadState,
    LossFn,
    OptimStep,
    Sample,
    SaveState,
    SaveWeights,
    SessionCreate,
)
from moetune.service.errors import APIException, documented_errors, invalid_request
from moetune.service.routes import training_sessions
from moetune.service.sessions import records
from moetune.service.tinker import wire
from moetune.service.tinker.auth import check_sdk_version, tinker_tenant
from moetune.service.tinker.state import Future, Model, TinkerSession, TinkerState, new_id

router = APIRouter(prefix="/tinker/api/v1", tags=["tinker"], dependencies=[Depends(tinker_tenant)],
                   responses=documented_errors(
                       (400, "The request body could not be parsed"),
                       (401, "Missing or invalid Tinker API key"),
                       (404, "No such session, model, sampler or request on this server"),
                       (409, "The session has finished, or a seq_id arrived out of order"),
                       (410, "A heartbeat for a session that has finished"),
                       (422, "Invalid request or SDK version; `error.param` names the field or header")))
_POLL_S = 40.0  # under the SDK's 45 s read timeout of retrieve_future
_CLIP = (0.8, 1.2)  # ppo's and cispo's ratio bounds unless loss_fn_config names them (Tinker's defaults)
_PROTOBUF = "application/x-protobuf"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a saved state's or weights' name (SaveState.name)
_SAMPLE_FIELDS = {"n": "num_samples", "max_tokens": "sampling_params.max_tokens"}  # Sample's names in Tinker's


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the SDK's `type` tags and fields this server does not use


def _state(request: Request) -> TinkerState:
    return request.app.state.tinker


def _idempotency(key: str | None) -> tuple:
    return ("key", key or new_id("unkeyed"))


# ---------------------------------------------------------------- client and session


class ClientConfigRequest(_Body):
    sdk_version: str


@router.post("/client/config")
def client_config(body: ClientConfigRequest) -> dict:
    """The SDK's feature flags: API keys (no JWT exchange), forward_backward chunks one at a time in seq_id order,
    plain protobuf bodies, httpx's own transport, custom losses on the client."""
    check_sdk_version(body.sdk_version)
    return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False,
            "use_pyqwest_transport": False, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
            "sample_join_sampling_session": False}


@router.post("/client/dynamic_config")
def client_dynamic_config() -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.post("/telemetry")
def telemetry() -> dict:
    """The SDK's own telemetry: accepted and dropped."""
    return {"status": "accepted"}


class CreateSession(_Body):
    sdk_version: str


@router.post("/create_session")
def create_session(body: CreateSession, request: Request, tenant: str = Depends(tinker_tenant)) -> dict:
    check_sdk_version(body.sdk_version)
    session_id = new_id("tks")
    _state(request).sessions[session_id] = TinkerSession(tenant=tenant)
    return {"type": "create_session", "session_id": session_id}


class Heartbeat(_Body):
    session_id: str


@router.post("/session_heartbeat")
def session_heartbeat(body: Heartbeat, request: Request, tenant: str = Depends(tinker_tenant)) -> dict:
    if _state(request).session(tenant, body.session_id).finished:
        raise APIException(410, ErrorCode.session_not_open, f"Tinker session {body.session_id} has finished.")
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, request: Request, tenant: str = Depends(tinker_tenant)) -> dict:
    """Closes the session's models (their worker groups stop; what they saved stays)."""
    state, store = _state(request), request.app.state.store
    found = state.session(tenant, session_id)
    found.finished = True
    for model_id in found.models:
        row = records.get_session(store, state.models[model_id].session_id, tenant)
        if row is not None and records.is_open(row):
            training_sessions.close(row.id, request, tenant, store)
    return {}


# ---------------------------------------------------------------- models


class LoraConfig(_Body):
    rank: int = Field(32, ge=1, le=1024)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModel(_Body):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})


def _lora(config: LoraConfig) -> LoraSpec:
    """Tinker's LoRA switches as moetune's presets; train_mlp covers the experts too (Tinker: "including MoE
    layers"). The unembedding is never adapted here (train_unembed is not honoured)."""
    if config.train_attn and config.train_mlp:
        targets, experts = "all-linear", True
    elif config.train_attn:
        targets, experts = "attention", False
    elif config.train_mlp:
        targets, experts = "mlp", True
    else:
        raise invalid_request("lora_config: train_mlp or train_attn must be true (train_unembed alone is not "
                              "supported)", "lora_config")
    return LoraSpec(rank=config.rank, alpha=32.0, dropout=0.0, target_modules=targets, train_experts=experts)


def _new_model(request: Request, tenant: str, session_id: str, model_seq_id: int, base_model: str,
               lora: LoraSpec, seed: int | None, role: str = "train") -> tuple[str, Model]:
    """A moetune training session for Tinker model `<session>:<role>:<n>`: a training client's (role "train", the
    id the SDK derives too) or a base sampler's own group (role "base")."""
    state = _state(request)
    tinker_session = state.session(tenant, session_id)
    if tinker_session.finished:
        raise APIException(409, ErrorCode.session_not_open, f"Tinker session {session_id} has finished.")
    created = training_sessions.create(SessionCreate(model=base_model, lora=lora, seed=seed), request, tenant,
                                       request.app.state.store)
    model_id = f"{session_id}:{role}:{model_seq_id}"
    model = Model(tenant=tenant, session_id=created.id, base_model=base_model, lora_rank=lora.rank)
    state.add_model(tinker_session, model_id, model)
    return model_id, model


@router.post("/create_model")
def create_model(body: CreateModel, request: Request, tenant: str = Depends(tinker_tenant)) -> dict:
    """Starts the model's worker group; its future is done once the group is ready."""
    if body.optimizer_config.get("type", "adamw") != "adamw":
        raise invalid_request(f"optimizer_config.type: only 'adamw' is supported, not "
                              f"{body.optimizer_config.get('type')!r}", "optimizer_config.type")
    lora = _lora(body.lora_config)

    def submit() -> Future:
        model_id, model = _new_model(request, tenant, body.session_id, body.model_seq_id, body.base_model, lora,
                                     body.lora_config.seed)
        return Future(tenant, "create_model", model.session_id, model_id=model_id)

    return _future_id(_state(request).once(("model", body.session_id, body.model_seq_id), submit))


class GetInfo(_Body):
    model_id: str


@router.post("/get_info")
def get_info(body: GetInfo, request: Request, tenant: str = Depends(tinker_tenant)) -> dict:
    model = _state(request).model(tenant, body.model_id)
    return {"type": "get_info", "model_id": body.model_id, "is_lora": True, "lora_rank": model.lora_rank,
            "model_name": model.base_model,
            "model_data": {"model_name": model.base_model, "tokenizer_id": model.base_model}}


# ---------------------------------------------------------------- training calls


def _call(request: Request, tenant: str, future: Future, args: CallArgs) -> Future:
    """Queues `args` on the future's session: the future now names the call."""
    call = training_sessions.queue_call(future.session_id, args, request, tenant, request.app.state.store)
    future.call_id = call.id
    return future


def _training(request: Request, tenant: str, model_id: str, seq_id: int | None, op: str, args: CallArgs,
              idempotency_key: str | None, **extra) -> dict:
    state = _state(request)
    model = state.model(tenant, model_id)

    def submit() -> Future:
        return _call(request, tenant, Future(tenant, op, model.session_id, model_id=model_id, extra=extra), args)

    if seq_id is None:
        return _future_id(state.once(_idempotency(idempotency_key), submit))
    return _future_id(state.in_turn(model, model_id, seq_id, submit))


def _loss_call(request: wire.ForwardBackwardRequest) -> Forward | ForwardBackward:
    if request.forward_only:
        return Forward(data=request.data)
    if request.loss_fn not in get_args(LossFn):
        raise invalid_request(f"loss_fn {request.loss_fn!r} is not supported by this server (it runs "
                              f"cross_entropy, importance_sampling, ppo and cispo; forward_backward_custom runs "
                              f"any loss on the client)", "forward_backward_input.loss_fn")
    clip = (request.config.get("clip_low_threshold", _CLIP[0]), request.config.get("clip_high_threshold", _CLIP[1]))
    try:
        return ForwardBackward(data=request.data, loss_fn=request.loss_fn, clip_range=clip, accumulate=True)
    except ValueError as e:  # a loss's missing inputs (advantages, the sampler's logprobs)
        raise invalid_request(f"forward_backward_input: {e}", "forward_backward_input.data") from None


@router.post("/forward_backward")
async def forward_backward(request: Request, tenant: str = Depends(tinker_tenant),
                           x_idempotency_key: str | None = Header(None)) -> dict:
    """Protobuf in (Tinker's ForwardBackwardRequest); the gradients add up until optim_step."""
    if _PROTOBUF not in request.headers.get("content-type", "") or request.headers.get("content-encoding"):
        raise invalid_request(f"forward_backward takes an uncompressed {_PROTOBUF} body", "content-type")
    parsed = wire.forward_backward_request(await request.body())
    args = _loss_call(parsed)
    return await run_in_threadpool(_training, request, tenant, parsed.model_id, parsed.seq_id or None,
                                   args.kind, args, x_idempotency_key)


class AdamParams(_Body):
    learning_rate: float = Field(1e-4, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)
    type: str = "adam"


class OptimStepRequest(_Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


@router.post("/optim_step")
def optim_step(body: OptimStepRequest, request: Request, tenant: str = Depends(tinker_tenant),
               x_idempotency_key: str | None = Header(None)) -> dict:
    if body.adam_params is None:
        raise invalid_request(f"optimizer_params: only Adam is supported, not "
                              f"{(body.optimizer_params or {}).get('type')!r}", "optimizer_params.type")
    adam = body.adam_params
    args = OptimStep(learning_rate=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps,
                     weight_decay=adam.weight_decay, grad_clip_norm=adam.grad_clip_norm)
    return _training(request, tenant, body.model_id, body.seq_id, "optim_step", args, x_idempotency_key)


class SaveWeightsRequest(_Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None


def _name(body: SaveWeightsRequest) -> str:
    name = body.path or f"sampler-{body.seq_id or new_id('s')}"
    if not _NAME.fullmatch(name):
        raise invalid_request(f"path {name!r}: a name of letters, digits, '.', '_' or '-' (at most 64)", "path")
    return name


@router.post("/save_weights")
def save_weights(body: SaveWeightsRequest, request: Request, tenant: str = Depends(tinker_tenant),
                 x_idempotency_key: str | None = Header(None)) -> dict:
    """Tinker's save_state: weights and optimizer state, at tinker://<model>/weights/<name>."""
    name = _name(body)
    return _training(request, tenant, body.model_id, body.seq_id, "save_weights", SaveState(name=name),
                     x_idempotency_key, name=name)


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveWeightsRequest, request: Request, tenant: str = Depends(tinker_tenant),
                             x_idempotency_key: str | None = Header(None)) -> dict:
    """The adapter as it is now, for samplers (tinker://<model>/sampler_weights/<name>): a snapshot, which later
    steps do not change."""
    name = _name(body)
    _state(request).model(tenant, body.model_id)
    sampler = _state(request).add_sampler(body.model_id, name) if body.sampling_session_seq_id is not None else None
    return _training(request, tenant, body.model_id, body.seq_id, "save_weights_for_sampler",
                     SaveWeights(name=name), x_idempotency_key, name=name, sampler=sampler)


class LoadWeightsRequest(_Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None  # with model_seq_id: a new model, created from the state at `path`
    model_seq_id: int | None = None
    base_model: str | None = None


def _tinker_path(path: str, kind: str) -> tuple[str, str]:
    """(model id, name) of tinker://<model id>/<kind>/<name>."""
    model_id, _, rest = path.removeprefix("tinker://").partition("/")
    found_kind, _, name = rest.partition("/")
    if not path.startswith("tinker://") or found_kind != kind or not name:
        raise invalid_request(f"path {path!r}: expected tinker://<model id>/{kind}/<name>", "path")
    return model_id, name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


@router.post("/load_weights")
def load_weights(body: LoadWeightsRequest, request: Request, tenant: str = Depends(tinker_tenant),
                 x_idempotency_key: str | None = Header(None)) -> dict:
    """A saved state into a model (optimizer state too with `optimizer`), or into a new model of `session_id`
    (another session's state: the tenant's own)."""
    state, store = _state(request), request.app.state.store
    source_id, name = _tinker_path(body.path, "weights")
    source = state.model(tenant, source_id)
    row = records.get_session(store, source.session_id, tenant)
    args = LoadState(name=name, optimizer=body.optimizer, uri=f"{row.output_uri.rstrip('/')}/states/{name}")
    if body.session_id is None:
        if body.model_id is None:
            raise invalid_request("model_id, or session_id and model_seq_id, is required", "model_id")
        return _training(request, tenant, body.model_id, body.seq_id, "load_weights", args, x_idempotency_key,
                         path=body.path)
    if body.model_seq_id is None:
        raise invalid_request("model_seq_id is required with session_id", "model_seq_id")
    spec = row.spec

    def submit() -> Future:
        model_id, model = _new_model(request, tenant, body.session_id, body.model_seq_id,
                                     body.base_model or source.base_model, LoraSpec.model_validate(spec["lora"]),
                                     None)
        return _call(request, tenant, Future(tenant, "load_weights", model.session_id, model_id=model_id,
                                             extra={"path": body.path}), args)

    return _future_id(state.once(("model", body.session_id, body.model_seq_id), submit))


# ---------------------------------------------------------------- sampling


class CreateSamplingSession(_Body):
    session_id: str
    sampling_session_seq_id: int
    model_path: str | None = None
    base_model: str | None = None


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSession, request: Request,
                            tenant: str = Depends(tinker_tenant)) -> dict:
    """A sampler of saved weights (`model_path`), or of the bare base model: the adapter off on a worker group of
    this session that holds that base, or on a group of its own (started now) when none does."""
    state = _state(request)
    state.session(tenant, body.session_id)
    if body.model_path is not None:
        model_id, name = _tinker_path(body.model_path, "sampler_weights")
        state.model(tenant, model_id)
    elif body.base_model is not None:
        model_id, name = _base_holder(request, tenant, body.session_id, body.sampling_session_seq_id,
                                      body.base_model), None
    else:
        raise invalid_request("model_path or base_model is required", "model_path")
    sampler_id = state.add_sampler(model_id, name, f"{body.session_id}:sample:{body.sampling_session_seq_id}")
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}  # resent: the same sampler


def _base_holder(request: Request, tenant: str, session_id: str, seq_id: int, base_model: str) -> str:
    """A model of the session on `base_model` whose group is open; else a new one (its adapter never trained, the
    smallest: it only ever runs with the adapter off)."""
    state, store = _state(request), request.app.state.store
    for model_id in state.session(tenant, session_id).models:
        model = state.models[model_id]
        row = records.get_session(store, model.session_id, tenant)
        if model.base_model == base_model and row is not None and records.is_open(row):
            return model_id

    def submit() -> Future:
        model_id, model = _new_model(request, tenant, session_id, seq_id, base_model,
                                     LoraSpec(rank=1, alpha=1.0, dropout=0.0, target_modules="attention",
                                              train_experts=False), None, role="base")
        return Future(tenant, "create_model", model.session_id, model_id=model_id)

    return state.futures[state.once(("base", session_id, seq_id), submit)].model_id


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, request: Request, tenant: str = Depends(tinker_tenant)) -> dict:
    state = _state(request)
    model_id, name = _sampler(state, tenant, sampler_id)
    return {"sampler_id": sampler_id, "base_model": state.models[model_id].base_model,
            "model_path": tinker_path(model_id, "sampler_weights", name) if name else None}


def _sampler(state: TinkerState, tenant: str, sampler_id: str) -> tuple[str, str | None]:
    found = state.samplers.get(sampler_id)
    if found is None or state.models[found[0]].tenant != tenant:
        raise APIException(404, ErrorCode.not_found, f"No sampler {sampler_id!r} on this server.",
                           "sampling_session_id")
    return found


class SamplingParams(_Body):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class SampleRequest(_Body):
    num_samples: int = Field(1, ge=1)
    prompt: dict[str, Any]
    sampling_params: SamplingParams
    sampling_session_id: str | None = None
    model_path: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    prompt_logprobs_last_n: int | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0


def _prompt(prompt: dict) -> list[int]:
    tokens = []
    for i, chunk in enumerate(prompt.get("chunks", [])):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise invalid_request(f"prompt.chunks[{i}]: only encoded_text chunks are supported", "prompt.chunks")
        tokens += chunk["tokens"]
    if not tokens:
        raise invalid_request("prompt: no tokens", "prompt")
    return tokens


@router.post("/asample")
def asample(body: SampleRequest, request: Request, tenant: str = Depends(tinker_tenant),
            x_idempotency_key: str | None = Header(None)) -> dict:
    """Draws from the sampler's snapshot (the weights as save_weights_for_sampler saved them)."""
    state = _state(request)
    if body.topk_prompt_logprobs or body.topk_sample_logprobs:
        raise invalid_request("top-k logprobs are not supported", "topk_sample_logprobs")
    if body.sampling_session_id is not None:
        model_id, name = _sampler(state, tenant, body.sampling_session_id)
    elif body.model_path is not None:
        model_id, name = _tinker_path(body.model_path, "sampler_weights")
    else:
        raise invalid_request("sampling_session_id or model_path is required", "sampling_session_id")
    model = state.model(tenant, model_id)
    params = body.sampling_params
    stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    asks_prompt = bool(body.prompt_logprobs)
    try:
        args = Sample(prompts=[_prompt(body.prompt)], n=body.num_samples, max_tokens=params.max_tokens or 16,
                      temperature=params.temperature, top_p=params.top_p,
                      top_k=params.top_k if params.top_k > 0 else -1, stop=stop,
                      seed=params.seed % 2**31 if params.seed is not None else None, weights=name,
                      adapter=name is not None, prompt_logprobs=asks_prompt)
    except ValidationError as e:  # beyond what one call draws (num_samples, max_tokens)
        error = e.errors()[0]
        field = _SAMPLE_FIELDS.get(str(error["loc"][0]), str(error["loc"][0]))
        raise invalid_request(f"{field}: {error['msg']}", field) from None

    def submit() -> Future:
        return _call(request, tenant, Future(tenant, "sample", model.session_id, model_id=model_id,
                                             extra={"prompt_logprobs": asks_prompt,
                                                    "last_n": body.prompt_logprobs_last_n}), args)

    identity = ("sample", body.sampling_session_id, body.seq_id) if body.seq_id is not None \
        else _idempotency(x_idempotency_key)
    request_id = state.once(identity, submit)
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}.{i}" for i in range(body.num_samples)]}


# ---------------------------------------------------------------- futures


def _future_id(request_id: str) -> dict:
    return {"request_id": request_id}


class RetrieveFuture(_Body):
    request_id: str


def _failed(message: str, user: bool) -> dict:
    return {"error": message, "category": "user" if user else "server"}


def _outcome(request: Request, future: Future) -> dict | Response | None:
    """The future's answer once its call (or, for create_model, its group) is done; None while it runs."""
    store = request.app.state.store
    if future.call_id is None:  # create_model: ready with its group
        row = records.get_session(store, future.session_id)
        if row.status == "ready":
            return {"type": "create_model", "model_id": future.model_id}
        if not records.is_open(row):
            return _failed(f"the model's worker group did not start: {(row.error or {}).get('message', row.status)}",
                           user=False)
        return None
    call = records.get_call(store, future.session_id, future.call_id)
    if call.status == records.FAILED:
        error = call.error or {}
        return _failed(error.get("message", "failed"), user=error.get("code") == ErrorCode.invalid_request)
    if call.status != records.SUCCEEDED:
        return None
    result, extra = call.result, future.extra
    if future.op in ("forward", "forward_backward"):
        return Response(wire.forward_backward_output(result), media_type=_PROTOBUF)
    if future.op == "sample":
        return Response(wire.sample_response(result, extra["prompt_logprobs"], extra["last_n"]),
                        media_type=_PROTOBUF)
    if future.op == "optim_step":
        return {"type": "optim_step", "metrics": {"step": float(result["step"])}}
    if future.op == "save_weights":
        return {"type": "save_weights", "path": tinker_path(future.model_id, "weights", extra["name"])}
    if future.op == "save_weights_for_sampler":
        return {"type": "save_weights_for_sampler", "path": tinker_path(future.model_id, "sampler_weights",
                                                                         extra["name"]),
                "sampling_session_id": extra["sampler"]}
    if future.op == "load_weights":
        return {"type": "load_weights", "path": extra["path"], "model_id": future.model_id}
    raise AssertionError(future.op)


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFuture, request: Request, tenant: str = Depends(tinker_tenant)):
    """The future's result, waiting up to _POLL_S for it; `try_again` after that (the SDK polls again). The wait
    holds no thread: an RL step's samples each have a poll open."""
    future = _state(request).future(tenant, body.request_id)
    answer = await request.app.state.session_changes.wait_for_async(lambda: _outcome(request, future), _POLL_S)
    if answer is None:  # a long wait in vain: is the group still there to run it?
        await run_in_threadpool(training_sessions.retrieve, future.session_id, request, tenant,
                                request.app.state.store)
        answer = await run_in_threadpool(_outcome, request, future)
    if answer is None:
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    return answer
