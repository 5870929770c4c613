"""Nemotron-H's facts: Mamba2 mixers (in_proj; PEFT refuses their out_proj), attention, and latent MoE (plain up/down
experts working at moe_latent_size between fc1/fc2_latent_proj; a shared expert)."""

FACTS = dict(expert_count_keys=("n_routed_experts",),
             linear_names=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj",
                           "fc1_latent_proj", "fc2_latent_proj"))
