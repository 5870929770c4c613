"""The official `tinker` SDK (the version tests pin) against the real control plane and a real session group on
the tiny kimi_linear: create, forward_backward with three losses adding up, optim_step, save_weights_for_sampler,
sample, compute_logprobs, a stale sampler, the base model's sampler, save_state, a new client from that state,
close. One training client, shared by the checks in order (its worker group is the expensive part)."""

from __future__ import annotations

import time

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from bench.support.waiting import wait_for
from moetune.service.tinker.auth import SDK_VERSIONS
from tests.support.control_plane import TOKENS

pytestmark = pytest.mark.ray_job

SEQ = [5, 17, 33, 48, 62, 71, 90, 104, 7, 12]
PROMPT = [5, 17, 33]
API_KEY = "tml-" + TOKENS["tenant-a"]


def _datum(tokens: list[int], **inputs) -> types.Datum:
    """Tinker's shifted datum: model_input[:-1] predicts tokens[1:]."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def _logprobs(output) -> list[list[float]]:
    return [out["logprobs"].tolist() for out in output.loss_fn_outputs]


@pytest.fixture(scope="module")
def service(control_plane):
    client = tinker.ServiceClient(base_url=f"{control_plane}/tinker", api_key=API_KEY)
    yield client


@pytest.fixture(scope="module")
def trainer(service, tiny_assets):
    return service.create_lora_training_client(base_model=tiny_assets["model"], rank=4, seed=3).result(timeout=300)


def _raw(control_plane: str, path: str, **kwargs) -> httpx.Response:
    headers = {"X-API-Key": API_KEY, "X-Stainless-Package-Version": SDK_VERSIONS[-1], **kwargs.pop("headers", {})}
    return httpx.post(f"{control_plane}/tinker/api/v1/{path}", headers=headers, timeout=60, **kwargs)


def test_the_sdk_trains_samples_and_restores_through_moetune(service, trainer, control_plane, tiny_assets):
    n = len(SEQ) - 1
    # three losses before one step: their gradients add up
    started = time.perf_counter()  # nothing queued before it: the round trip is this call's alone
    ce = trainer.forward_backward([_datum(SEQ, weights=[1.0] * n)], "cross_entropy").result(timeout=120)
    print(f"tinker_call_overhead_ms={(time.perf_counter() - started) * 1e3 - ce.metrics['worker_ms:sum']:.1f}")
    (before,) = _logprobs(ce)
    assert len(before) == n and all(lp < 0 for lp in before)
    assert ce.metrics["loss:sum"] == pytest.approx(-sum(before), rel=1e-5)
    rl = {"logprobs": before, "advantages": [1.0] * n}
    trainer.forward_backward([_datum(SEQ, **rl)], "importance_sampling").result(timeout=120)
    ppo = trainer.forward_backward([_datum(SEQ, **rl)], "ppo",
                                   {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result(timeout=120)
    assert ppo.metrics["loss:sum"] == pytest.approx(-n, rel=1e-4)  # ratio 1: the advantages' sum
    step = trainer.optim_step(types.AdamParams(learning_rate=5e-3, grad_clip_norm=1.0)).result(timeout=120)
    assert step.metrics["step"] == 1
    after = _logprobs(trainer.forward([_datum(SEQ, weights=[1.0] * n)], "cross_entropy").result(timeout=120))[0]
    assert sum(after) > sum(before)  # every loss pushed SEQ up

    sampler = trainer.save_weights_and_get_sampling_client().result(timeout=120)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, top_p=0.95, top_k=20, seed=7, stop=[SEQ[3]])
    drawn = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=4, sampling_params=params) \
        .result(timeout=120)
    assert len(drawn.sequences) == 4
    for s in drawn.sequences:
        assert len(s.logprobs) == len(s.tokens) and all(lp <= 0 for lp in s.logprobs)
        if s.stop_reason == "stop":  # the stop token ends the tokens, with its logprob
            assert s.tokens[-1] == SEQ[3] and SEQ[3] not in s.tokens[:-1]
        else:
            assert s.stop_reason == "length" and len(s.tokens) == 6 and SEQ[3] not in s.tokens
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(SEQ)).result(timeout=120)
    assert scored[0] is None and scored[1:] == pytest.approx(after, abs=1e-4)

    # the sampler is a snapshot: a step later it answers as before, a new one from the new weights
    trainer.forward_backward([_datum(SEQ, weights=[1.0] * n)], "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=120)
    stale = sampler.compute_logprobs(types.ModelInput.from_ints(SEQ)).result(timeout=120)
    assert stale[1:] == pytest.approx(scored[1:], abs=1e-5)
    fresh = trainer.save_weights_and_get_sampling_client().result(timeout=120) \
        .compute_logprobs(types.ModelInput.from_ints(SEQ)).result(timeout=120)
    assert max(abs(a - b) for a, b in zip(fresh[1:], scored[1:])) > 1e-2  # the step moved them
    # the bare base model (DPO's reference): the trainer's group with its adapter off, as before any step
    base = service.create_sampling_client(base_model=tiny_assets["model"]) \
        .compute_logprobs(types.ModelInput.from_ints(SEQ)).result(timeout=120)
    assert base[1:] == pytest.approx(before, abs=1e-4)

    # save_state, and a new training client (its own worker group) from it: the same weights
    path = trainer.save_state("s1").result(timeout=120).path
    assert path.startswith("tinker://") and path.endswith("/weights/s1")
    now = _logprobs(trainer.forward([_datum(SEQ, weights=[1.0] * n)], "cross_entropy").result(timeout=120))[0]
    restored = service.create_training_client_from_state(path).result(timeout=300)
    again = _logprobs(restored.forward([_datum(SEQ, weights=[1.0] * n)], "cross_entropy").result(timeout=120))[0]
    assert again == pytest.approx(now, abs=1e-5)


def test_a_resent_forward_backward_trains_once(trainer, control_plane):
    """The SDK resends a request it got no answer to: with its idempotency key, or (a retry of the whole call) a
    new key and the same seq_id. Both get the first future: one call runs."""
    seq_id = trainer._get_request_id() + 1  # this request's place in the model's order, as the SDK reserves it
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[_datum(SEQ, weights=[1.0] * (len(SEQ) - 1))],
                                                          loss_fn="cross_entropy"),
        model_id=trainer.model_id, seq_id=seq_id)
    body = forward_backward_request_to_proto(request).SerializeToString()
    proto = {"Content-Type": "application/x-protobuf"}
    first = _raw(control_plane, "forward_backward", content=body, headers={**proto, "X-Idempotency-Key": "k1"})
    same_key = _raw(control_plane, "forward_backward", content=body, headers={**proto, "X-Idempotency-Key": "k1"})
    new_key = _raw(control_plane, "forward_backward", content=body, headers={**proto, "X-Idempotency-Key": "k2"})
    assert first.status_code == 200, first.text
    assert first.json() == same_key.json() == new_key.json()
    trainer._turn_counter += 1  # the SDK's own turn for the request sent by hand
    assert trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120).metrics["step"] == 3
    # the step applied the one forward_backward queued: a second step finds nothing to apply
    again = _raw(control_plane, "optim_step", json={"model_id": trainer.model_id, "seq_id": trainer._get_request_id()
                                                    + 1, "adam_params": {"learning_rate": 1e-3}})
    trainer._turn_counter += 1
    outcome = _raw(control_plane, "retrieve_future", json=again.json()).json()
    assert outcome["category"] == "user" and "no gradients to apply" in outcome["error"], outcome

def test_other_sdk_versions_and_unsupported_losses_are_refused_by_name(trainer, control_plane):
    old = _raw(control_plane, "client/config", json={"sdk_version": "0.37.0"},
               headers={"X-Stainless-Package-Version": "0.37.0"})
    assert old.status_code == 422 and "0.37.0" in old.text and SDK_VERSIONS[-1] in old.text
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[_datum(SEQ, weights=[1.0] * (len(SEQ) - 1))],
                                                          loss_fn="dro"),
        model_id=trainer.model_id, seq_id=10**6)
    refused = _raw(control_plane, "forward_backward", headers={"Content-Type": "application/x-protobuf"},
                   content=forward_backward_request_to_proto(request).SerializeToString())
    assert refused.status_code == 422 and "'dro'" in refused.text, refused.text
    too_many = _raw(control_plane, "asample", json={
        "num_samples": 200, "prompt": {"chunks": [{"tokens": PROMPT}]}, "sampling_params": {},
        "model_path": f"tinker://{trainer.model_id}/sampler_weights/any"})
    assert too_many.status_code == 422 and too_many.json()["error"]["param"] == "num_samples", too_many.text
    assert _raw(control_plane, "client/config", json={"sdk_version": SDK_VERSIONS[-1]},
                headers={"X-API-Key": "tml-wrong"}).status_code == 401


def test_more_samples_at_once_than_the_server_has_threads_are_answered(trainer):
    """An RL step's samples each keep a retrieve_future poll open: 64 at once, more than the control plane's
    threadpool (40), whose threads the group's own requests (take a call, report it) need."""
    sampler = trainer.save_weights_and_get_sampling_client().result(timeout=120)
    params = types.SamplingParams(max_tokens=1, seed=1)
    started = time.perf_counter()
    futures = [sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params)
               for _ in range(64)]
    assert all(len(f.result(timeout=60).sequences) == 1 for f in futures)
    print(f"64 concurrent samples: {time.perf_counter() - started:.1f} s")


def test_close_finishes_the_session_and_its_models(service, control_plane):
    """close() finishes the Tinker session: its models' training sessions close (their groups stop)."""
    with httpx.Client(base_url=control_plane, headers={"Authorization": f"Bearer {TOKENS['tenant-a']}"}) as http:
        def open_sessions() -> set[str]:
            listed = http.get("/v1/training_sessions", params={"limit": 100}).json()["data"]
            return {s["id"] for s in listed if s["status"] in ("starting", "ready")}

        ours = open_sessions()
        assert len(ours) == 2  # the trainer's and the one restored from its state
        service.close("success").result(timeout=60)
        wait_for(lambda: not ours & open_sessions(), 60, "the models' sessions closed", interval=0.1)
