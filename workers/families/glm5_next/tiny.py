from moetune.workers.families.spec import TinyVision


def tiny_config(**overrides):
    from transformers import Glm5NextConfig

    text = {"vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 4, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 0,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 16, "index_topk": 16, "index_kpool": 4,
            "index_head_dim": 16, "index_n_heads": 2, "linear_head_dim": 16, "linear_num_heads": 4, "hc_mult": 2,
            "pad_token_id": 0, "max_position_embeddings": 512}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    return Glm5NextConfig(text_config={**text, **overrides}, vision_config=vision)


def _image_processor(vision):
    """14-pixel patches merged 2x2, 1 to 9 image tokens an image (GLM resizes within a token budget)."""
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    return Glm5NextImageProcessorPil(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                     merge_size=vision.spatial_merge_size, min_image_tokens=1, max_image_tokens=9)


# the token names its own processor and config use; GLM tells video from image tokens by the video start/end spans:
# those tokens must exist too
TINY_VISION = TinyVision({"image_start_token_id": "<|begin_of_image|>", "image_token_id": "<|image|>",
                          "image_end_token_id": "<|end_of_image|>", "video_token_id": "<|video|>",
                          "video_start_token_id": "<|begin_of_video|>", "video_end_token_id": "<|end_of_video|>"},
                         "<|begin_of_image|><|image|><|end_of_image|>", _image_processor)
