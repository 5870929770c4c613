"""Activation bytes of one sequence of `seq_len` tokens, from a forward of the job's trainable model on the meta
device (no memory, no compute: only shapes), counted as the tuner's CPU measure counts them (planner.saved).

The forward is the one a job runs, on the model workers.model builds for the meta device: the family's kernel swaps,
PEFT LoRA, the method's loss, training mode; the routed experts are stand-ins that save nothing (planner.experts
adds their share); attention and KDA save what the workers' kernels save (planner.device_ops). Every sequence is
taken as `seq_len` long and unpadded, as the tuner assumes. Each decoder layer's share is recorded, which gives the
figure with activation checkpointing too: every layer then keeps only its input hidden states, and the backward
reruns one layer at a time with all of its activations. Up to MEASURED_UP_TO tokens the forward runs at `seq_len`
itself; beyond, bytes are the quadratic through three measured lengths, so a term that grows with T² (a [T, T] mask)
is extrapolated as one.

With context parallelism over `context` ranks the forward is the CP one of the group's last rank (planner.context):
its slice of seq_len / context tokens, the whole row's gathered MLA keys, the KDA state summaries of every rank.
At a fixed group size its bytes are a polynomial of the slice's length too (the slice's own grow with it, the
gathered keys with the row, size × slice; the summaries with the size alone), fitted the same way through shorter
slices: the meta forward's cost is the KDA kernel's loop over the slice's chunks, and a plan may try six sizes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch

from moetune.workers.methods.batch import Batch
from moetune.workers.planner.context import last_context_rank
from moetune.workers.planner.device_ops import kernels_as_run_on
from moetune.workers.planner.saved import SavedBytes
from moetune.workers.planner.work import Work
from moetune.workers.pipeline.stages import text_model

MEASURED_UP_TO = 16384
_FIT_LENGTHS = (4096, 8192, 16384)
CONTEXT_MEASURED_UP_TO = 4096  # tokens of a CP rank's slice
_CONTEXT_FIT_LENGTHS = (1024, 2048, 4096)


@dataclass(frozen=True)
class Activations:
    """Saved bytes of one sequence: outside the decoder layers (embeddings, final norm), per decoder layer, each
    layer's input hidden states, and the output layer with the loss (logits); of `outside`, what the forward saved
    before its first layer (`before_layers`: a pipeline's first stage holds it, its last the rest); and what its
    forward's kernels do besides (planner.work): each layer's attention operations, the bytes its CP all-gathers
    receive."""

    outside: float
    layers: tuple[float, ...]
    layer_inputs: tuple[float, ...]
    loss: float
    attention_flops: tuple[float, ...] = ()
    received: float = 0.0
    before_layers: float = 0.0

    def saved(self, layers: tuple[float, ...], checkpointing: bool) -> float:
        """Without the loss, given each layer's bytes (these, plus what the planner adds for experts)."""
        if checkpointing:
            return self.outside + sum(self.layer_inputs) + max(layers, default=0.0)
        return self.outside + sum(layers)

    def combine(self, weights: tuple[float, ...], others: tuple[Activations, ...]) -> Activations:
        """Σ weight_i · profile_i, field by field (the extrapolation's quadratic)."""
        profiles = (self, *others)

        def mix(get):
            values = [get(p) for p in profiles]
            if isinstance(values[0], tuple):
                return tuple(sum(w * v[i] for w, v in zip(weights, values)) for i in range(len(values[0])))
            return sum(w * v for w, v in zip(weights, values))

        return Activations(mix(lambda p: p.outside), mix(lambda p: p.layers), mix(lambda p: p.layer_inputs),
                           mix(lambda p: p.loss), mix(lambda p: p.attention_flops), mix(lambda p: p.received),
                           mix(lambda p: p.before_layers))


def _first_tensor(args, kwargs):
    return next((a for a in (*args, kwargs.get("hidden_states")) if isinstance(a, torch.Tensor)), None)


class _Recorder:
    """Forward hooks that add the saved bytes (and attention operations) of each decoder layer of the text model,
    by layer (a method's no-grad reference forward, DPO's, adds its operations and nothing saved), and note the
    saved total before the output layer."""

    def __init__(self, model, counter: SavedBytes, work: Work | None = None):
        self.counter, self.work, self.head_start, self.first_start = counter, work or Work(), None, 0.0
        layers = text_model(model).layers
        self.layers, self.inputs, self.flops = ([0.0] * len(layers) for _ in range(3))
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        self._starts = {}
        self._handles = []
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._leave))
        head = model.get_output_embeddings()
        self._handles.append(head.register_forward_pre_hook(lambda *_: setattr(self, "head_start", counter.total)))

    def _enter(self, module, args, kwargs):
        hidden = _first_tensor(args, kwargs)
        self.inputs[self._index[id(module)]] += 0.0 if hidden is None else float(hidden.untyped_storage().nbytes())
        self._starts[id(module)] = self.counter.total, self.work.flops
        if self._index[id(module)] == 0:  # the last forward's (DPO's no-grad reference forward runs first)
            self.first_start = self.counter.total

    def _leave(self, module, args, output):
        saved, flops = self._starts.pop(id(module))
        self.layers[self._index[id(module)]] += float(self.counter.total - saved)
        self.flops[self._index[id(module)]] += self.work.flops - flops

    def remove(self):
        for handle in self._handles:
            handle.remove()


def _no_packed_sequence_check():
    """transformers looks for packed sequences in the position ids with a data-dependent test; a planned sequence
    is one unpacked sequence."""
    return mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda position_ids: None)


def _measure(model, method, seq_len: int, context: int, device_type: str = "cuda") -> Activations:
    """One example of the method (DPO's: a pair, both answers in one batch as its loss needs), per sequence, on
    the last of `context` CP ranks (`seq_len` tokens of each row: its slice), with the kernels of `device_type`
    workers."""
    sequences = method.sequences_per_example
    ids = torch.zeros((sequences, seq_len), dtype=torch.long, device="meta")
    counter, work = SavedBytes(model), Work()
    recorder = _Recorder(model, counter, work)
    split = last_context_rank(model, seq_len, context) if context > 1 else contextlib.nullcontext()
    try:
        with split, counter.counting(), work.counting(), _no_packed_sequence_check(), \
                torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True), \
                kernels_as_run_on(device_type):  # DSA: top-k keeps all
            method.loss_sum(model, Batch({"input_ids": ids}, ids, sequences * seq_len))
    finally:
        recorder.remove()
    head_start = counter.total if recorder.head_start is None else recorder.head_start
    example = Activations(head_start - sum(recorder.layers), tuple(recorder.layers), tuple(recorder.inputs),
                          counter.total - head_start, tuple(recorder.flops), work.received, recorder.first_start)
    return example.combine((1 / sequences,), ())


def activations(model, method, seq_len: int, device_type: str, context: int = 1) -> Activations:
    """Saved bytes of one `seq_len`-token sequence through `model` (with its stand-ins installed), on one of
    `context` CP ranks (the one that holds most), on `device_type` workers."""
    slice_tokens = seq_len // context
    up_to, fit = (MEASURED_UP_TO, _FIT_LENGTHS) if context == 1 else (CONTEXT_MEASURED_UP_TO, _CONTEXT_FIT_LENGTHS)
    if slice_tokens <= up_to:
        return _measure(model, method, slice_tokens, context, device_type)
    a, b, c = (_measure(model, method, t, context, device_type) for t in fit)
    return a.combine(_lagrange(fit, slice_tokens), (b, c))


def _lagrange(xs: tuple[int, ...], x: int) -> tuple[float, ...]:
    """Weights of the values at `xs` that give the interpolating polynomial's value at `x`."""
    weights = []
    for i, xi in enumerate(xs):
        w = 1.0
        for j, xj in enumerate(xs):
            if j != i:
                w *= (x - xj) / (xi - xj)
        weights.append(w)
    return tuple(weights)
