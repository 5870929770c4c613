"""Qwen3-Next's facts."""

from moetune.workers.families.linears import MLP

FACTS = dict(expert_count_keys=("num_experts",),
             linear_names=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj",
                           "shared_expert_gate") + MLP)
