def tiny_config(**overrides):
    from transformers import DeepseekV3Config

    values = {"vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
              "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
              "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
              "tie_word_embeddings": False}
    return DeepseekV3Config(**{**values, **overrides})
