"""The expert-parallel module's dispatch keeps routing counts on the device: at EP=1 its forward and backward read
no tensor value back to the host (on CUDA each such read is a host sync per layer; EP>1 needs exactly one, the
all-to-all split sizes). Tensor.tolist/item are wrapped by a counting probe that still calls through, so the
numbers the module computes are checked against transformers' own experts module as well."""

import torch
from torch import nn

from moetune.workers.families import REGISTRY
from moetune.workers.experts.compute import fused_expert_forward
from moetune.workers.experts.module import ExpertParallelExperts
from moetune.workers.experts.placement import placement_at
from moetune.workers.reporting.expert_load import ExpertLoad


def test_ep1_dispatch_reads_nothing_back_and_matches_transformers(monkeypatch):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = REGISTRY["qwen3_moe"].tiny_config()
    torch.manual_seed(0)
    reference = Qwen3MoeExperts(config)
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.2)
    ours = ExpertParallelExperts(reference, placement_at(config.to_dict(), 1, 0), lora_rank=8)
    assert ours.compute is fused_expert_forward
    tokens, top_k = 40, config.num_experts_per_tok
    index = torch.stack([torch.randperm(config.num_experts)[:top_k] for _ in range(tokens)])
    index[:, 0] = 1  # one expert gets every token, others none: counts of 0 take the same path
    weights = torch.rand(tokens, top_k).softmax(-1)
    x = torch.randn(tokens, config.hidden_size, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _f=original, _n=name: reads.append(_n) or _f(t, *a))
    got = ours(x, index, weights)
    got.square().sum().backward()
    monkeypatch.undo()
    assert reads == []

    want = reference(x_ref, index, weights)  # B = 0: the LoRA adds nothing yet
    want.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    assert ours.lora_gate_up_b.grad.abs().sum() > 0
    assert ours.tokens_per_expert.tolist() == torch.bincount(index.flatten(), minlength=config.num_experts).tolist()


def test_expert_load_counts_what_the_dispatch_counted_without_a_bincount(monkeypatch):
    """The load metrics take the dispatch's on-device counts: no torch.bincount of their own (on CUDA it reads the
    largest index back to the host, once per MoE layer and forward), the same counts as one over the routing."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = REGISTRY["qwen3_moe"].tiny_config()
    experts = ExpertParallelExperts(Qwen3MoeExperts(config), placement_at(config.to_dict(), 1, 0))
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"mlp": nn.ModuleDict({"experts": experts})})])})
    load = ExpertLoad(model.train())
    index = torch.randint(0, config.num_experts, (40, config.num_experts_per_tok))
    weights = torch.rand(40, config.num_experts_per_tok)
    bincounts = []
    original = torch.bincount
    monkeypatch.setattr(torch, "bincount", lambda *a, **k: bincounts.append(a) or original(*a, **k))
    for _ in range(2):
        experts(torch.randn(40, config.hidden_size), index, weights)
    monkeypatch.undo()
    assert bincounts == []
    assert load.layers == ["0"]
    assert load.totals[0, 0].tolist() == (2 * torch.bincount(index.flatten(), minlength=config.num_experts)).tolist()
