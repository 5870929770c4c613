from moetune.workers.families.spec import TinyVision


def tiny_config(**overrides):
    from transformers import Qwen3_5MoeConfig

    text = {"vocab_size": 272, "hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    return Qwen3_5MoeConfig(text_config={**text, **overrides}, vision_config=vision, tie_word_embeddings=False)


def _image_processor(vision):
    """16-pixel patches merged 2x2: a 32x32 image is one image token, 64x64 four."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                    merge_size=vision.spatial_merge_size,
                                    size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64})


# the token names its own processor and config use
TINY_VISION = TinyVision({"vision_start_token_id": "<|vision_start|>", "image_token_id": "<|image_pad|>",
                          "vision_end_token_id": "<|vision_end|>", "video_token_id": "<|video_pad|>"},
                         "<|vision_start|><|image_pad|><|vision_end|>", _image_processor)
