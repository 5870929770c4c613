"""Tinker's protobuf bodies (wire.proto): forward_backward's request in, the results of forward_backward and
sample out. A Tinker datum predicts target_tokens[t] from model_input[:t + 1]; moetune's Datum predicts
targets[t] from tokens[:t] (entry 0 unused), so a datum of N positions becomes N + 1 tokens, its per-position
inputs shifted by one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetune.api.models.training_sessions import Datum
from moetune.service.errors import invalid_request
from moetune.service.tinker import wire_pb2 as pb

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
# per-position inputs, by Tinker's name: moetune's Datum field
_INPUTS = {"weights": "weights", "advantages": "advantages", "logprobs": "logprobs"}


@dataclass
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def _tensor(message: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NUMPY.get(message.dtype)
    if dtype is None or message.WhichOneof("encoding") != "dense":
        raise invalid_request(f"{where}: only dense float32/int64 tensors are supported", where)
    return np.frombuffer(message.dense, dtype=dtype)


def _datum(message: pb.Datum, where: str) -> Datum:
    tokens: list[int] = []
    for j, chunk in enumerate(message.model_input):
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise invalid_request(f"{where}.model_input.chunks[{j}]: only encoded_text chunks are supported "
                                  f"(not {chunk.WhichOneof('chunk')})", f"{where}.model_input")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    inputs = {name: _tensor(t, f"{where}.loss_fn_inputs.{name}") for name, t in message.loss_fn_inputs.items()}
    if "target_tokens" not in inputs:
        raise invalid_request(f"{where}.loss_fn_inputs: target_tokens is required", f"{where}.loss_fn_inputs")
    for name, values in inputs.items():
        if len(values) != len(tokens):
            raise invalid_request(f"{where}.loss_fn_inputs.{name} has {len(values)} entries, model_input "
                                  f"{len(tokens)} tokens: one per position", f"{where}.loss_fn_inputs.{name}")
    if not tokens:
        raise invalid_request(f"{where}.model_input is empty", f"{where}.model_input")
    targets = inputs["target_tokens"].astype(np.int64).tolist()
    shifted = {field: [0.0] + inputs[name].astype(np.float64).tolist()
               for name, field in _INPUTS.items() if name in inputs}
    return Datum(tokens=tokens + targets[-1:], targets=tokens[:1] + targets, **shifted)


def forward_backward_request(body: bytes) -> ForwardBackwardRequest:
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: the body is not the message
        raise invalid_request("the body is not a Tinker ForwardBackwardRequest (protobuf)") from None
    config = {k: v.number for k, v in message.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"} \
        or dict(message.loss_fn_config)
    data = [_datum(d, f"forward_backward_input.data[{i}]") for i, d in enumerate(message.data)]
    if not data:
        raise invalid_request("forward_backward_input.data is empty", "forward_backward_input.data")
    return ForwardBackwardRequest(model_id=message.model_id, seq_id=message.seq_id, loss_fn=message.loss_fn,
                                  config=config, forward_only=message.forward_only, data=data)


def _batched(arrays: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    sizes = [a.nbytes for a in arrays]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=dtype)


def forward_backward_output(result: dict) -> bytes:
    """Each datum's target logprobs (N, the moetune entries after the first), the summed loss and the worker's time
    on the call (bench/rl.py's tinker_call_overhead_ms subtracts it)."""
    logprobs = [np.asarray(lp[1:], dtype=np.float32) for lp in result["logprobs"]]
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(logprobs),
                            fields={"logprobs": _batched(logprobs, pb.DTYPE_FLOAT32)})
    metrics = {"worker_ms:sum": float(result["worker_ms"])}
    if "loss" in result:
        metrics["loss:sum"] = float(result["loss"])
    return pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                    metrics=metrics).SerializeToString()


def sample_response(result: dict, prompt_logprobs: bool, last_n: int | None = None) -> bytes:
    """The sequences with their stop token (and its logprob) at the end, as Tinker returns them; the prompt's
    logprobs (its last `last_n` only, given) NaN where none was asked for, as the SDK reads them."""
    response = pb.SampleResponse()
    for s in result["sequences"]:
        stop = [s["stop_token"]] if s.get("stop_token") is not None else []
        logprobs = s["logprobs"] + ([s["stop_logprob"]] if stop else [])
        response.sequences.add(
            stop_reason=pb.STOP_REASON_LENGTH if s["finish_reason"] == "length" else pb.STOP_REASON_STOP,
            tokens=np.asarray(s["tokens"] + stop, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes())
    if prompt_logprobs and result["sequences"]:
        values = np.asarray(result["sequences"][0]["prompt_logprobs"], dtype=np.float32)
        values[: len(values) - last_n if last_n else 1] = np.nan  # nothing predicts the first prompt token
        response.prompt_logprobs = values.tobytes()
    return response.SerializeToString()
