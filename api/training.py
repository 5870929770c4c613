"""The SDK of training sessions: the user's own loop (RL, custom losses) on a LoRA held by a worker group.

    training = Training(Client(url, token))
    session = training.create({"model": "tiny-kimi-k3", "parallelism": {"num_workers": 2}})
    out = session.sample(["2+3="], n=4, max_tokens=4).result()
    fb = session.forward_backward(data, loss_fn="importance_sampling")   # a future: .result() or `await fb`
    fb = session.forward_backward_custom(data, my_loss)   # my_loss(data, logprobs) -> a torch scalar, run here
    session.optim_step(learning_rate=1e-4).result()
    session.close()

Every call returns at once with a CallFuture; the session runs its calls one at a time in the order they were made,
so a loop may queue a forward_backward and an optim_step and wait for the last alone.

When the worker group fails (a worker or its driver lost), or on restart() (restart(fresh=True): a fresh LoRA), the
control plane starts a new one that loads the newest save_state; the calls the old group had not finished raise CallFailed with `restarted` true and
`restored_step` (the step the session is back at), so the loop can go on from there.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from moetune.api.client import APIError, Client, _typed
from moetune.api.errors import ErrorCode
from moetune.api.models.responses import ErrorInfo, ListPage
from moetune.api.serving import Deployment
from moetune.api.models.training_sessions import (
    OPEN_STATUSES,
    CallArgs,
    CallCreate,
    Datum,
    Forward,
    ForwardBackward,
    LoadState,
    OptimStep,
    Sample,
    SaveState,
    SaveWeights,
    SessionCall,
    SessionCreate,
    TrainingSession,
)

SESSIONS_PATH = "/v1/training_sessions"
_POLL_S = 30.0  # one long poll of a call's state


class CallFailed(Exception):
    """A call's error. `restarted`: the worker group was replaced before it finished the call; after a failed group,
    the new one (after a restart the user asked for too) resumed from `restored_state` at `restored_step` (None and
    0: a fresh LoRA, no state was saved)."""

    def __init__(self, call: SessionCall):
        error = call.error or ErrorInfo(code="unknown", message="no error recorded")
        super().__init__(f"{call.kind} {call.id} failed: {error.code}: {error.message}"
                         + (f" (param: {error.param})" if error.param else ""))
        self.call, self.code, self.param = call, error.code, error.param
        self.restarted = error.code == ErrorCode.session_restarted
        self.restored_state = (call.result or {}).get("restored_state")
        self.restored_step = (call.result or {}).get("restored_step")


class CallFuture:
    def __init__(self, http, call: SessionCall):
        self._http, self.call = http, call

    def done(self) -> bool:
        return self.call.status in ("succeeded", "failed")

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The call's result once it ran; CallFailed for its error, TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"{self.call.kind} {self.call.id} still {self.call.status} after {timeout} s")
            self.call = _typed(self._http, "GET", f"{SESSIONS_PATH}/{self.call.session_id}/calls/{self.call.id}",
                               SessionCall, params={"wait_s": left}, timeout=left + 30.0)
        if self.call.status == "failed":
            raise CallFailed(self.call)
        return self.call.result or {}

    def __await__(self):
        return asyncio.to_thread(self.result).__await__()


class CustomLossFuture(CallFuture):
    """forward_backward_custom's future: the surrogate's call; its result's `loss` is the user's loss (the
    surrogate's, -Σ w·logp, is `surrogate_loss`)."""

    def __init__(self, future: CallFuture, result: dict[str, Any]):
        super().__init__(future._http, future.call)
        self._result = result

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        surrogate = super().result(timeout)
        return {**surrogate, "surrogate_loss": surrogate["loss"], **self._result}


class Session:
    """One training session; each method queues a call and returns its CallFuture."""

    def __init__(self, http, session: TrainingSession):
        self._http, self.id, self.info = http, session.id, session

    def _call(self, call: CallArgs) -> CallFuture:
        return CallFuture(self._http, _typed(self._http, "POST", f"{SESSIONS_PATH}/{self.id}/calls", SessionCall,
                                             json=CallCreate(call=call).model_dump(mode="json")))

    def forward_backward(self, data: list[Datum | dict], loss_fn: str = "cross_entropy",
                         clip_epsilon: float = 0.2) -> CallFuture:
        """Result: `loss` (summed over the weighted tokens of all sequences) and `logprobs` (per sequence, per
        token, entry 0 being 0)."""
        return self._call(ForwardBackward(data=data, loss_fn=loss_fn, clip_epsilon=clip_epsilon))

    def forward(self, data: list[Datum | dict], adapter: bool = True) -> CallFuture:
        """Result: `logprobs` (per sequence, per token, entry 0 being 0); no gradient is kept. `adapter=False`: the
        base model's (a reference policy's)."""
        return self._call(Forward(data=data, adapter=adapter))

    def forward_backward_custom(self, data: list[Datum | dict], loss_fn) -> CustomLossFuture:
        """forward_backward with your own loss: `loss_fn(data, logprobs)` gets the data (Datum) and one torch
        tensor of per-token logprobs per sequence and returns a scalar tensor (or it and a dict of metrics). It
        runs here, on the client, after a forward (this call waits for it); the workers then apply its gradient
        through a linear surrogate loss (moetune.api.custom_loss). Result: your `loss`, `metrics`, `logprobs`."""
        from moetune.api.custom_loss import surrogate_weights  # torch: only a custom loss needs it on the client

        data = [Datum.model_validate(d) for d in data]
        logprobs = self.forward(data).result()["logprobs"]
        loss, metrics, weights = surrogate_weights(data, logprobs, loss_fn)
        call = ForwardBackward(data=[d.model_copy(update={"weights": w}) for d, w in zip(data, weights)])
        return CustomLossFuture(self._call(call), {"loss": loss, "metrics": metrics, "logprobs": logprobs})

    def optim_step(self, **adam: float) -> CallFuture:
        """AdamW on the gradients since the last step: learning_rate, beta1, beta2, eps, weight_decay."""
        return self._call(OptimStep(**adam))

    def sample(self, prompts: list[str | list[int]], n: int = 1, max_tokens: int = 16, temperature: float = 1.0,
               stop: list[str | int] = (), seed: int | None = None, adapter: bool = True) -> CallFuture:
        """Result: `sequences`, n per prompt in prompt order, each with prompt_tokens, tokens, logprobs, text;
        `merged_calls`: how many calls drew in the same generation. `adapter=False`: from the base model."""
        return self._call(Sample(prompts=prompts, n=n, max_tokens=max_tokens, temperature=temperature,
                                 stop=list(stop), seed=seed, adapter=adapter))

    def save_state(self, name: str) -> CallFuture:
        return self._call(SaveState(name=name))

    def load_state(self, name: str) -> CallFuture:
        return self._call(LoadState(name=name))

    def save_weights(self, name: str) -> CallFuture:
        """Result: `uri`, a PEFT adapter folder for the base (deploy(name) serves it)."""
        return self._call(SaveWeights(name=name))

    def deploy(self, name: str) -> Deployment:
        """Serves the weights saved under `name` on the Serve app: call `model` at `base_url` with an OpenAI
        client (the app may still be DEPLOYING when this returns)."""
        return _typed(self._http, "POST", f"{SESSIONS_PATH}/{self.id}/weights/{name}/deploy", Deployment,
                      timeout=120.0)

    def retrieve(self) -> TrainingSession:
        self.info = _typed(self._http, "GET", f"{SESSIONS_PATH}/{self.id}", TrainingSession)
        return self.info

    def wait_ready(self, timeout: float, poll_interval: float = 1.0) -> TrainingSession:
        """Until the worker group takes calls; APIError-free but RuntimeError when the session ended instead."""
        deadline = time.monotonic() + timeout
        while (info := self.retrieve()).status != "ready":
            if info.status not in OPEN_STATUSES:
                raise RuntimeError(f"session {self.id} is {info.status}: {info.error or info.close_reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"session {self.id} not ready after {timeout} s")
            time.sleep(poll_interval)
        return info

    def restart(self, fresh: bool = False) -> TrainingSession:
        """A new worker group resuming from the newest save_state (a fresh LoRA before the first, or with
        `fresh=True`); the running call fails naming what it resumes from, as does the answer's `restored_state`
        and `restored_step` (None and 0: a fresh LoRA)."""
        self.info = _typed(self._http, "POST", f"{SESSIONS_PATH}/{self.id}/restart", TrainingSession,
                           params={"fresh": "true" if fresh else "false"})
        return self.info

    def close(self) -> TrainingSession:
        self.info = _typed(self._http, "POST", f"{SESSIONS_PATH}/{self.id}/close", TrainingSession)
        return self.info


class Training:
    def __init__(self, client: Client):
        self._http = client._http

    def create(self, spec: SessionCreate | dict) -> Session:
        body = spec.model_dump(mode="json", exclude_unset=True) if isinstance(spec, SessionCreate) else spec
        return Session(self._http, _typed(self._http, "POST", SESSIONS_PATH, TrainingSession, json=body))

    def session(self, session_id: str) -> Session:
        return Session(self._http, _typed(self._http, "GET", f"{SESSIONS_PATH}/{session_id}", TrainingSession))

    def list(self, limit: int = 20) -> ListPage[TrainingSession]:
        return _typed(self._http, "GET", SESSIONS_PATH, ListPage[TrainingSession], params={"limit": limit})


__all__ = ["APIError", "CallFailed", "CallFuture", "Session", "Training"]
