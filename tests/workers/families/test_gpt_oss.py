"""gpt-oss's experts in the expert-parallel module: transposed [E, in, out] tensors, biases and the clamped,
interleaved SwiGLU give transformers' own GptOssExperts output and input gradient, also where both clamps bite
(the EP-vs-PEFT training checks in tests/workers/experts run the tiny model, whose activations stay below the
released limit of 7)."""

import torch

from moetune.workers.families import REGISTRY
from moetune.workers.experts.compute import grouped_expert_forward
from moetune.workers.experts.module import ExpertParallelExperts
from moetune.workers.experts.placement import placement_at


def test_ep_experts_match_gpt_oss_experts_through_both_clamps():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    fam = REGISTRY["gpt_oss"]
    config = fam.tiny_config(swiglu_limit=0.4)
    torch.manual_seed(0)
    reference = GptOssExperts(config)
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.2)
    ours = ExpertParallelExperts(reference, placement_at(config.to_dict(), 1, 0),
                                 activation=fam.expert_activation(reference))
    assert ours.compute is grouped_expert_forward  # kernels.moe has no biases

    tokens, top_k = 24, config.num_experts_per_tok
    index = torch.stack([torch.randperm(config.num_local_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k).softmax(-1)
    x = torch.randn(tokens, config.hidden_size, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    want, got = reference(x_ref, index, weights), ours(x, index, weights)
    gate_up = x_ref @ reference.gate_up_proj[0] + reference.gate_up_proj_bias[0]
    assert (gate_up[..., ::2] > 0.4).any() and (gate_up[..., 1::2].abs() > 0.4).any()  # both clamps bite
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
