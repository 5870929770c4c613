"""Qwen3.5 MoE's facts: Gated DeltaNet + gated attention under a vision tower (frozen); image rows go through its
image processor."""

from moetune.workers.families.linears import MLP

FACTS = dict(expert_count_keys=("num_experts",),
             linear_names=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                           "in_proj_a", "out_proj", "shared_expert_gate") + MLP,
             text_config_key="text_config", images=True)
