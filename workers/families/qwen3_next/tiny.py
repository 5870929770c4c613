def tiny_config(**overrides):
    from transformers import Qwen3NextConfig

    values = {"vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
              "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
              "tie_word_embeddings": False}
    return Qwen3NextConfig(**{**values, **overrides})
