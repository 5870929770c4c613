def tiny_config(**overrides):
    from transformers import GptOssConfig

    values = {"vocab_size": 272, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
              "num_experts_per_tok": 2, "sliding_window": 8, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    return GptOssConfig(**{**values, **overrides})
