def tiny_config(**overrides):
    from transformers import DeepseekV4Config

    values = {"vocab_size": 272, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 16,
              "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
              "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                              "compressed_sparse_attention"],
              "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "hc_mult": 2, "hc_sinkhorn_iters": 3,
              "sliding_window": 8, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 16,
              "index_topk": 4, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
              "swiglu_limit": 0.1}  # small enough that the experts' clamp acts on tiny random weights
    return DeepseekV4Config(**{**values, **overrides})
