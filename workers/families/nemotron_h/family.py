"""Nemotron-H: a hybrid of Mamba2 mixers, a few attention layers and latent MoE layers. Each MoE block projects
tokens down to `moe_latent_size` (fc1_latent_proj), routes them to plain MLP experts (up_proj, relu², down_proj;
no gate) and projects back (fc2_latent_proj), beside a shared expert. Expert parallelism replaces the experts
module only, so tokens travel the all-to-all at latent width. The Mamba2 layers run transformers' own code."""

from moetune.api.families import FAMILIES
from moetune.workers.families.spec import Family


def expert_activation(experts):
    return experts.act_fn  # plain MLP experts: act(x W_up), no gating


def tiny_config(**overrides):
    from transformers import NemotronHConfig

    values = {"vocab_size": 272, "hidden_size": 64, "layers_block_type": ["mamba", "moe", "attention", "moe"],
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4,
              "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 8, "intermediate_size": 64,
              "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "moe_latent_size": 32, "n_group": 1, "topk_group": 1,
              "tie_word_embeddings": False}
    return NemotronHConfig(**{**values, **overrides})


FAMILY = Family(FAMILIES["nemotron_h"], moe_block="NemotronHMoE", shared_experts="shared_experts",
                tiny_config=tiny_config, expert_activation=expert_activation,
                lora_unsupported=("out_proj",))  # PEFT: Mamba's out_proj bypasses its forward in the fused kernels
