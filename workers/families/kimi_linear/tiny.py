def tiny_config(vocab_size: int = 272, pad_token_id: int = 256, bos_token_id: int = 257, eos_token_id: int = 258,
                **overrides):
    """Its vocabulary and special tokens (by default workers.tiny's tokenizer's, rounded up) configure the model;
    other overrides are set on the config afterwards."""
    from transformers import KimiLinearConfig

    num_layers = 4
    config = KimiLinearConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        # the released MLA head ratio (nope 128 : rope 64 : v 128): the key wider than the value
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        # the released shape: mostly KDA, one full-attention layer; first MLP dense
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1),
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=4096,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config
