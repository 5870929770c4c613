"""The planner against what the workers really hold, at small scale on CPU (fp32, as CPU jobs train): LoRA parameter
and gradient bytes of the model the workers build (workers.model.trainable_model), per EP rank, exactly; optimizer
state exactly as torch AdamW's state after one step (the client optimizer DeepSpeed wraps) plus its fp32 master
copy; and activation bytes per sequence within 10 % of the bytes autograd saves (the tuner's CPU measure,
MemoryProbe), for four families, two sequence lengths, activation checkpointing off and on (on: what the forward
saves, plus the largest one layer's rerun saves in the backward), for the two sparse-attention families, and for
Kimi K3 split over 4 gloo context-parallel ranks (the last rank's, which gathers the most)."""

import json
import os

import pytest
import torch

from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import RunConfig, resolve_run_config
from moetune.workers.families import REGISTRY
from moetune.workers.loop.tuner import MemoryProbe
from moetune.workers.methods import method_for
from moetune.workers.methods.batch import Batch
from moetune.workers.methods.sft import token_loss_sum
from moetune.workers.model import trainable_model
from moetune.workers.experts.placement import placement_at
from moetune.workers.planner.memory import breakdown
from moetune.workers.planner.activations import _Recorder
from moetune.workers.planner.model import model_facts
from moetune.workers.planner.saved import SavedBytes
from tests.support.layouts import layout
from bench.support.harness import launch
from bench.support.tiny_models import plain_model

FAMILIES = ("kimi_linear", "qwen3_moe", "deepseek_v3", "gpt_oss")


def _spec(seq_len: int = 64, train_experts: bool = False, targets="all-linear", checkpointing=False,
          context: int = 1) -> RunConfig:
    parallelism = ({"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 1} if context == 1 else
                   {"num_workers": context, "context_parallel_size": context, "zero_stage": 1})
    return resolve_run_config(JobCreate(
        model="file:///unused", training_file="file:///unused",
        lora={"rank": 8, "target_modules": targets, "train_experts": train_experts},
        training={"seq_len": seq_len, "activation_checkpointing": checkpointing}, parallelism=parallelism), 0)


def _worker_model(name: str, spec: RunConfig, ep: int):
    """The model a rank trains, built as the workers build it (kernel swaps, LoRA, its share of the experts)."""
    model = plain_model(REGISTRY[name])
    REGISTRY[name].apply_kernel_swaps(model)
    return trainable_model(model, spec.lora, spec.training, placement_at(model.config.to_dict(), ep, 0)).train()


def _facts(name: str, spec: RunConfig):
    return model_facts(REGISTRY[name].tiny_config().to_dict(), spec, torch.float32, "cpu")


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("train_experts, targets", [(False, "all-linear"), (True, ["o_proj"])])
@pytest.mark.parametrize("ep", [1, 2])
def test_lora_parameters_and_gradients_are_exact(name, train_experts, targets, ep):
    spec = _spec(train_experts=train_experts, targets=targets)
    model = _worker_model(name, spec, ep)
    parts = breakdown(_facts(name, spec), layout(ep, ep, 1, False, 1))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert parts["lora_parameters"] == sum(p.nbytes for p in trainable)
    if ep == 1:  # a backward at EP=2 needs the other rank's all-to-all
        ids = torch.randint(0, 256, (1, 16))
        token_loss_sum(model(input_ids=ids).logits, ids).backward()
        assert parts["lora_gradients"] == sum(p.grad.nbytes for p in trainable)


@pytest.mark.parametrize("name", FAMILIES[:2])
def test_optimizer_state_is_adamw_state_plus_the_fp32_master(name):
    spec = _spec(train_experts=True, targets=["o_proj"])
    model = _worker_model(name, spec, 1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    ids = torch.randint(0, 256, (1, 16))
    token_loss_sum(model(input_ids=ids).logits, ids).backward()
    optimizer.step()
    moments = sum(state[k].nbytes for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    master = sum(p.numel() * 4 for p in trainable)
    parts = breakdown(_facts(name, spec), layout(1, 1, 1, False, 1))
    assert parts["optimizer_state"] == moments + master


def _saved_by_forward(name: str, spec: RunConfig, rank: int = 0) -> tuple[float, tuple[float, ...]]:
    """What the tuner's CPU measure (MemoryProbe) sees in the forward of the worker's model (with context
    parallelism: CP rank `rank`'s, over its slice), the loss computed by its output layer as the step computes it;
    and each decoder layer's share, counted the same way."""
    from moetune.kernels.kda.context_slices import SliceLayout
    from moetune.workers.families.context import context_parallel

    model = _worker_model(name, spec, 1)
    method = method_for(spec.method, spec.training, tokenizer=None)
    method.prepare(model)
    seq_len, context = spec.training.seq_len, spec.parallelism.context_parallel_size
    tokens = seq_len // context
    ids = torch.randint(0, 256, (1, tokens))
    batch = Batch({"input_ids": ids}, ids, tokens)
    if context > 1:
        with context_parallel(model, SliceLayout.even(seq_len, context, rank)):
            return _saved(model, method, batch)
    return _saved(model, method, batch)


def _saved(model, method, batch: Batch) -> tuple[float, tuple[float, ...]]:
    probe = MemoryProbe(model, torch.device("cpu"))
    probe.begin()
    method.loss_sum(model, batch)
    probe.end()
    counter = SavedBytes(model)  # a second forward: saved-tensor hooks do not nest (the innermost counts alone)
    layers = _Recorder(model, counter)
    with counter.counting():
        method.loss_sum(model, batch)
    layers.remove()
    return probe.activation, tuple(layers.layers)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seq_len", [64, 256])
@pytest.mark.parametrize("train_experts", [False, True])
def test_activation_bytes_without_checkpointing(name, seq_len, train_experts):
    spec = _spec(seq_len, train_experts=train_experts)
    measured, _ = _saved_by_forward(name, spec)
    facts = _facts(name, spec)
    assert facts.activation_bytes(1, checkpointing=False) + facts.loss_bytes() == pytest.approx(measured,
                                                                                                    rel=0.10)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm5_next"])
def test_activation_bytes_of_sparse_attention_families(name):
    """The DSA families: on the meta device the sparse kernel runs shapes only (it has no data to select with) and
    saves what it saves on a device, so the plan matches the CPU forward here too."""
    spec = _spec(256)
    measured, _ = _saved_by_forward(name, spec)
    facts = _facts(name, spec)
    assert facts.activation_bytes(1, checkpointing=False) + facts.loss_bytes() == pytest.approx(measured,
                                                                                                    rel=0.10)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seq_len", [64, 256])
def test_activation_bytes_with_checkpointing(name, seq_len):
    """The forward keeps each layer's inputs (what the CPU measure sees); the backward's rerun of one layer saves
    that layer's activations, whose largest is measured on the same model without checkpointing (a rerun's saved
    tensors go through checkpoint's own hooks, out of an outer counter's sight)."""
    facts = _facts(name, _spec(seq_len, checkpointing=True))
    kept, _ = _saved_by_forward(name, _spec(seq_len, checkpointing=True))
    planned_kept = facts.activations().outside + sum(facts.activations().layer_inputs) + facts.loss_bytes()
    assert planned_kept == pytest.approx(kept, rel=0.10)
    _, layers = _saved_by_forward(name, _spec(seq_len))
    assert max(facts.layer_bytes(1)) == pytest.approx(max(layers), rel=0.10)
    assert facts.activation_bytes(1, True) == pytest.approx(planned_kept - facts.loss_bytes()
                                                             + max(facts.layer_bytes(1)))


def _context_rank(rank: int, world: int, out: str) -> None:
    """A CP rank's forward of the job's K3 model over its slice (workers.families.context), as a job's step runs
    it: what the CPU measure sees, on every rank."""
    saved, _ = _saved_by_forward("kimi_k3", _spec(256, context=world), rank)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(saved, f)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [4])
def test_activation_bytes_of_a_context_parallel_rank(tmp_path, world):
    """The plan of a K3 job at CP = `world` is what its last rank saves (its slice's activations, the whole row's
    gathered MLA keys, every rank's KDA state summary), measured in the real CP forward on gloo ranks; and it is
    less than the unsplit sequence's by more than the keys it gathers."""
    launch(_context_rank, world, str(tmp_path))
    saved = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    facts = _facts("kimi_k3", _spec(256, context=world))
    planned = facts.activation_bytes(1, False, world) + facts.loss_bytes(world)
    assert planned == pytest.approx(saved[-1], rel=0.10), (planned, saved)
    assert saved[-1] == max(saved)
    unsplit = facts.activation_bytes(1, False) + facts.loss_bytes()
    assert planned < unsplit * 0.4, (planned, unsplit)
