"""The planner's routed-expert share for Kimi K3 at the release's widths (examples/kimi-k3/config.json: latent 3584,
expert intermediate 3072), in bf16 as GPUs train: what planner.experts counts per MoE block is what the job's experts
module saves in a forward at another expert count and routed-slot count than it sampled, and the SiTU-GLU's share
of it is its bf16 input alone (no fp32 intermediates)."""

import json
from pathlib import Path

import torch

from moetune.api.models.job_create import JobCreate
from moetune.workers.families import REGISTRY
from moetune.workers.families.kimi_k3.configuration import KimiK3Config
from moetune.workers.families.kimi_k3.modeling import KimiK3Experts
from moetune.workers.planner.experts import _as_job_runs_it, _sample, expert_bytes
from moetune.workers.planner.saved import SavedBytes

RELEASE = Path(__file__).parents[3] / "examples" / "kimi-k3" / "config.json"


def _release_experts():
    text = KimiK3Config(**json.loads(RELEASE.read_text())).get_text_config()
    with torch.device("meta"):
        return KimiK3Experts(text), text


def test_planned_expert_bytes_are_what_the_k3_module_saves_in_bf16():
    experts, text = _release_experts()
    family, spec = REGISTRY["kimi_k3"], JobCreate(model="file:///unused", training_file="file:///unused")
    planned = expert_bytes(experts, family, spec.lora, spec.training, True, torch.bfloat16)  # K3: MXFP4 experts

    count, slots = 3, 40
    module = _as_job_runs_it(_sample(experts, count, torch.bfloat16), family, spec.lora, spec.training, True).train()
    latent, inner = text.routed_expert_hidden_size, text.moe_intermediate_size
    hidden = torch.randn(slots, latent, dtype=torch.bfloat16, requires_grad=True)
    weights = torch.rand(slots, 1, dtype=torch.bfloat16, requires_grad=True)
    index = (torch.arange(slots) % count).unsqueeze(-1)
    with SavedBytes(module).counting() as counter:
        module(hidden, index, weights)
    assert planned.of(count, slots) == counter.total

    kept = []  # a second forward: saved-tensor hooks do not nest (the innermost sees all)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        module(hidden, index, weights)

    kept = [t for t in kept if not isinstance(t, torch.nn.Parameter)]  # the frozen experts: not activations
    activation_input = [t for t in kept if t.shape[-1] == 2 * inner]
    assert [(t.dtype, t.shape[0]) for t in activation_input] == [(torch.bfloat16, slots)]
    assert not [t for t in kept if t.shape[-1] == inner]  # the GLU's fp32 halves, products and output
