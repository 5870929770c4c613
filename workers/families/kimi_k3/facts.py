"""Kimi K3's facts: KDA (full-rank output gate g_proj) + NoPE MLA (sigmoid output gate g_proj), latent MoE
(routed_expert_down/up_proj around the experts); the Attention Residuals' *_res_proj weights are the mixes'
pseudo-queries, never called as linears (no LoRA). Image rows go through its own processor (MoonViT3d's patches);
each image token is a `media_placeholder_token_id`."""

from moetune.workers.families.linears import MLA, MLP, mla_query_absent_beside_kda

FACTS = dict(expert_count_keys=("num_experts",),
             linear_names=MLA + MLP + ("k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj",
                                       "routed_expert_down_proj", "routed_expert_up_proj"),
             text_config_key="text_config", absent_linears=mla_query_absent_beside_kda, images=True,
             image_token_key="media_placeholder_token_id", context_parallel=True,
             pipeline=True, stage_block_key="attn_res_block_size")
