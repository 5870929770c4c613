"""The planner against what the workers really hold, at small scale on CPU (fp32, as CPU jobs train): LoRA parameter
and gradient bytes of the model the workers build (workers.model.trainable_model), per EP rank, exactly; optimizer
state exactly as torch AdamW's state after one step (the client optimizer DeepSpeed wraps) plus its fp32 master
copy; and activation bytes per sequence within 10 % of the bytes autograd saves (the tuner's CPU measure,
MemoryProbe), for four families, two sequence lengths, activation checkpointing off and on (on: what the forward
saves, plus the largest one layer's rerun saves in the backward), and for the two sparse-attention families."""

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
from bench.support.tiny_models import plain_model

FAMILIES = ("kimi_linear", "qwen3_moe", "deepseek_v3", "gpt_oss")


def _spec(seq_len: int = 64, train_experts: bool = False, targets="all-linear", checkpointing=False) -> RunConfig:
    return resolve_run_config(JobCreate(
        model="file:///unused", training_file="file:///unused",
        lora={"rank": 8, "target_modules": targets, "train_experts": train_experts},
        training={"seq_len": seq_len, "activation_checkpointing": checkpointing},
        parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 1}), 0)


def _worker_model(name: str, spec: RunConfig, ep: int):
    """The model a rank trains, built as the workers build it (kernel swaps, LoRA, its share of the experts)."""
    model = plain_model(REGISTRY[name])
    REGISTRY[name].apply_kernel_swaps(model)
    return trainable_model(model, spec.lora, spec.training, placement_at(model.config.to_dict(), ep, 0)).train()


def _facts(name: str, spec: RunConfig):
    return model_facts(REGISTRY[name].tiny_config().to_dict(), spec, torch.float32)


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


def _saved_by_forward(name: str, spec: RunConfig) -> tuple[float, tuple[float, ...]]:
    """What the tuner's CPU measure (MemoryProbe) sees in the forward of the worker's model, the loss computed by
    its output layer as the step computes it; and each decoder layer's share, counted the same way."""
    model = _worker_model(name, spec, 1)
    method = method_for(spec.method, spec.training, tokenizer=None)
    method.prepare(model)
    ids = torch.randint(0, 256, (1, spec.training.seq_len))
    batch = Batch({"input_ids": ids}, ids, spec.training.seq_len)
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
    assert facts.activation_bytes(1, checkpointing=False) + facts.activations.loss == pytest.approx(measured,
                                                                                                    rel=0.10)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm5_next"])
def test_activation_bytes_of_sparse_attention_families(name):
    """The DSA families: on the meta device the sparse kernel runs shapes only (it has no data to select with) and
    saves what it saves on a device, so the plan matches the CPU forward here too."""
    spec = _spec(256)
    measured, _ = _saved_by_forward(name, spec)
    facts = _facts(name, spec)
    assert facts.activation_bytes(1, checkpointing=False) + facts.activations.loss == pytest.approx(measured,
                                                                                                    rel=0.10)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seq_len", [64, 256])
def test_activation_bytes_with_checkpointing(name, seq_len):
    """The forward keeps each layer's inputs (what the CPU measure sees); the backward's rerun of one layer saves
    that layer's activations, whose largest is measured on the same model without checkpointing (a rerun's saved
    tensors go through checkpoint's own hooks, out of an outer counter's sight)."""
    facts = _facts(name, _spec(seq_len, checkpointing=True))
    kept, _ = _saved_by_forward(name, _spec(seq_len, checkpointing=True))
    planned_kept = facts.activations.outside + sum(facts.activations.layer_inputs) + facts.activations.loss
    assert planned_kept == pytest.approx(kept, rel=0.10)
    _, layers = _saved_by_forward(name, _spec(seq_len))
    assert max(facts.layer_bytes(1)) == pytest.approx(max(layers), rel=0.10)
    assert facts.activation_bytes(1, True) == pytest.approx(planned_kept - facts.activations.loss
                                                             + max(facts.layer_bytes(1)))
