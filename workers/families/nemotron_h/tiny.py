def tiny_config(**overrides):
    from transformers import NemotronHConfig

    values = {"vocab_size": 272, "hidden_size": 64, "layers_block_type": ["mamba", "moe", "attention", "moe"],
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4,
              "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 8, "intermediate_size": 64,
              "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "moe_latent_size": 32, "n_group": 1, "topk_group": 1,
              "tie_word_embeddings": False}
    return NemotronHConfig(**{**values, **overrides})
