def tiny_config(**overrides):
    from transformers import Qwen3MoeConfig

    values = {"vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "tie_word_embeddings": False}
    return Qwen3MoeConfig(**{**values, **overrides})
