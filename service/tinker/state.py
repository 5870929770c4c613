"""What the Tinker router remembers between requests, in this control plane's memory: Tinker's sessions, their
models (each a moetune training session) and samplers, the futures it handed out, and the requests it took (so a
retried one is answered with its first future, not run again).

Kept per replica: a Tinker client talks to the replica it started on (a second replica, or a restarted one, does
not know its session; the client then gets a 404 naming it)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from moetune.api.errors import ErrorCode
from moetune.service.errors import APIException

SEQ_WAIT_S = 30.0  # how long a training request waits for the ones numbered before it to arrive


@dataclass
class Model:
    """A Tinker training client: one moetune training session."""

    tenant: str
    session_id: str
    base_model: str
    lora_rank: int
    next_seq: int = 1  # the SDK numbers a model's training requests from 1


@dataclass
class Future:
    tenant: str
    op: str  # the Tinker call it answers (create_model, forward_backward, sample, ...)
    session_id: str  # the moetune session
    call_id: str | None = None  # its call; None for create_model (ready when the session is)
    model_id: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class TinkerSession:
    tenant: str
    models: list[str] = field(default_factory=list)
    finished: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class TinkerState:
    def __init__(self):
        self._turns = threading.Condition()
        self.sessions: dict[str, TinkerSession] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, tuple[str, str | None]] = {}  # sampler id: (model id, the weights' name or
        # None: the base model, the adapter off)
        self.futures: dict[str, Future] = {}
        self._taken: dict[tuple, str] = {}  # a request's identity: its future's id

    def session(self, tenant: str, session_id: str) -> TinkerSession:
        found = self.sessions.get(session_id)
        if found is None or found.tenant != tenant:
            raise APIException(404, ErrorCode.not_found, f"No Tinker session {session_id!r} on this server.",
                               "session_id")
        return found

    def model(self, tenant: str, model_id: str) -> Model:
        found = self.models.get(model_id)
        if found is None or found.tenant != tenant:
            raise APIException(404, ErrorCode.not_found, f"No Tinker model {model_id!r} on this server.", "model_id")
        return found

    def future(self, tenant: str, request_id: str) -> Future:
        found = self.futures.get(request_id)
        if found is None or found.tenant != tenant:
            raise APIException(404, ErrorCode.not_found, f"No request {request_id!r} on this server.", "request_id")
        return found

    def once(self, identity: tuple, submit: Callable[[], Future]) -> str:
        """The future of the request `identity` names: submitted now, or the one a first copy of it got (the SDK
        resends a request it got no answer to)."""
        with self._turns:
            if identity in self._taken:
                return self._taken[identity]
            return self._record(identity, submit())

    def in_turn(self, model: Model, model_id: str, seq_id: int, submit: Callable[[], Future]) -> str:
        """A training request in its model's order: it waits (up to SEQ_WAIT_S) for the requests numbered before
        it; a copy of one already taken gets its future."""
        identity = ("seq", model_id, seq_id)
        with self._turns:
            if identity in self._taken:
                return self._taken[identity]
            if not self._turns.wait_for(lambda: model.next_seq >= seq_id or identity in self._taken, SEQ_WAIT_S):
                raise APIException(409, ErrorCode.invalid_request, f"seq_id {seq_id} of model {model_id} waits for "
                                   f"seq_id {model.next_seq}, which has not arrived; retry", "seq_id")
            if identity in self._taken:
                return self._taken[identity]
            if seq_id < model.next_seq:
                raise APIException(409, ErrorCode.invalid_request, f"seq_id {seq_id} of model {model_id} comes after "
                                   f"{model.next_seq - 1}: seq_ids increase", "seq_id")
            request_id = self._record(identity, submit())
            model.next_seq = seq_id + 1
            self._turns.notify_all()
            return request_id

    def _record(self, identity: tuple, future: Future) -> str:
        request_id = new_id("req")
        self.futures[request_id] = future
        self._taken[identity] = request_id
        return request_id

    def add_model(self, tinker_session: TinkerSession, model_id: str, model: Model) -> None:
        self.models[model_id] = model
        tinker_session.models.append(model_id)

    def add_sampler(self, model_id: str, weights: str | None, sampler_id: str | None = None) -> str:
        sampler_id = sampler_id or new_id("smp")
        self.samplers[sampler_id] = (model_id, weights)
        return sampler_id
