"""The fused LoRA linear (one addmm for the update) against PEFT's own lora.Linear on the same weights: output and
every gradient, and PEFT's forward wherever the fused path does not apply."""

import contextlib
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear
from torch.utils._python_dispatch import TorchDispatchMode

from moetune.workers.lora.fused_linear import FusedLoraLinear, fuse_lora_linears


class _Ops(TorchDispatchMode):
    """The aten ops run inside."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _Block(torch.nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.proj = torch.nn.Linear(12, 8, bias=bias)

    def forward(self, x):
        return self.proj(x)


def _pair(dropout=0.0, bias=True):
    """The stock PEFT model and a copy with its LoRA linear fused; B drawn non-zero so the update counts."""
    torch.manual_seed(0)
    stock = get_peft_model(_Block(bias), LoraConfig(r=4, lora_alpha=12, lora_dropout=dropout, target_modules=["proj"]))
    torch.nn.init.normal_(stock.base_model.model.proj.lora_B["default"].weight)
    fused = copy.deepcopy(stock)
    assert fuse_lora_linears(fused) == 1
    return stock, fused


def _run(model, x):
    x = x.clone().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), x.grad, grads


def test_fused_linear_equals_peft_output_and_gradients():
    stock, fused = _pair()
    assert type(fused.base_model.model.proj) is FusedLoraLinear
    x = torch.randn(3, 5, 12)
    want, got = _run(stock, x), _run(fused, x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert set(got[2]) == set(want[2]) and len(got[2]) == 2
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-6, msg=name)
    with _Ops() as ops:
        fused(x)
    assert "addmm" in ops.names and "mul" not in ops.names  # the update inside the GEMM, no separate scaling


@pytest.mark.parametrize("case, fused_path", [("dropout", True), ("disabled", False), ("merged", False),
                                              ("LoRA in fp32, input in bf16", False)])
def test_what_the_fused_path_leaves_to_peft(case, fused_path):
    stock, fused = _pair(dropout=0.5 if case == "dropout" else 0.0, bias=False)
    x = torch.randn(2, 3, 12)
    if case == "merged":
        for model in (stock, fused):
            model.base_model.merge_adapter()
    if case.startswith("LoRA in fp32"):  # PEFT casts the input to LoRA's dtype; the fused path wants one dtype
        for model in (stock, fused):
            model.base_model.model.proj.base_layer.bfloat16()
        x = x.bfloat16()
    runs = []
    for model in (stock, fused):
        torch.manual_seed(3)  # the same dropout draws
        with model.disable_adapter() if case == "disabled" else contextlib.nullcontext(), _Ops() as ops:
            runs.append((model(x), ops.names))
    (want, _), (got, names) = runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ("addmm" in names) == fused_path, names  # no bias: only the fused update runs an addmm
    if case != "dropout":  # PEFT's update multiplies by its scaling (dropout multiplies by its mask)
        assert ("mul" in names) == case.startswith("LoRA"), names


def test_only_peft_linears_turn():
    model = get_peft_model(_Block(), LoraConfig(r=2, target_modules=["proj"]))
    turned = fuse_lora_linears(model)
    assert turned == 1 and fuse_lora_linears(model) == 0  # already fused ones are not PEFT's Linear exactly
    assert isinstance(model.base_model.model.proj, Linear)


@pytest.mark.parametrize("kernels", [True, False])
def test_a_job_fuses_its_lora_linears_with_custom_kernels_only(kernels):
    from moetune.workers.families import REGISTRY
    from moetune.workers.model import trainable_model
    from bench.support.harness import spec
    from bench.support.tiny_models import plain_model

    job = spec(ep=1, zero=2, kernels=kernels)
    model = trainable_model(plain_model(REGISTRY["qwen3_moe"]), job.lora, job.training, None)
    kinds = {type(m) for m in model.modules() if isinstance(m, Linear)}
    assert kinds == ({FusedLoraLinear} if kernels else {Linear})
