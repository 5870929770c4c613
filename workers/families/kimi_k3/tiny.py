from moetune.workers.families.spec import TinyVision

# A tiny text model of the released shape: both layer kinds (KDA: 1, 3; MLA: 2, 4 in the release's 1-indexed
# lists), dense layer 0, latent MoE after it, and an Attention-Residual block boundary at layer 2. Widths that the
# MXFP4 groups of 32 divide (latent 32, expert intermediate 32).
TINY_TEXT = {
    "vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "initializer_range": 0.1, "rms_norm_eps": 1e-5,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "routed_expert_hidden_size": 32,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 3],
                           "full_attn_layers": [2, 4], "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    "attn_res_block_size": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


# A tiny MoonViT3d + patchmergerv2 of the released kind: 1 block, 2 heads of 16 (the 2D rotary needs a multiple of
# 4), an 8x8 position table (a larger grid resizes it), 2x2 pooling.
TINY_VISION_CONFIG = {
    "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
    "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1, "vt_hidden_size": 32, "vt_intermediate_size": 64,
    "qkv_hidden_size": 32, "merge_kernel_size": [2, 2], "mm_projector_type": "patchmergerv2",
}


def tiny_config(**overrides):
    from moetune.workers.families.kimi_k3.configuration import KimiK3Config

    return KimiK3Config(text_config={**TINY_TEXT, **overrides}, vision_config=dict(TINY_VISION_CONFIG))


def _image_processor(vision: dict):
    """Small images stay small: at most 8 patches a side (a 56x56 image is 4x4 patches, 4 image tokens)."""
    from moetune.workers.families.kimi_k3.processor import KimiK3ImageProcessor

    return KimiK3ImageProcessor(patch_size=vision["patch_size"], merge_size=vision["merge_kernel_size"][0],
                                size={"max_height": 8, "max_width": 8}, max_patches=64)


# one placeholder token per image token (the release's <|media_pad|>); the template renders one per image part
TINY_VISION = TinyVision({"media_placeholder_token_id": "<|media_pad|>"}, "<|media_pad|>", _image_processor)
