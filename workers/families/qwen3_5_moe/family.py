"""Qwen3.5 MoE, text path: Gated DeltaNet linear attention in 3 of 4 layers, gated full attention, softmax router,
a sigmoid-gated shared expert. The checkpoint is multimodal (`Qwen3_5MoeForConditionalGeneration`, the text model
under `model.language_model`); the vision tower stays frozen and without LoRA. The DeltaNet core runs on
`kernels.kda` (workers.families.kda)."""

from moetune.api.families import FAMILIES
from moetune.workers.families.kda import kda_swap
from moetune.workers.families.spec import Family


def tiny_config(**overrides):
    from transformers import Qwen3_5MoeConfig

    text = {"vocab_size": 272, "hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    return Qwen3_5MoeConfig(text_config={**text, **overrides}, vision_config=vision, tie_word_embeddings=False)


FAMILY = Family(FAMILIES["qwen3_5_moe"], moe_block="Qwen3_5MoeSparseMoeBlock", shared_experts="shared_expert",
                tiny_config=tiny_config, auto_class="AutoModelForImageTextToText", lora_scope=".language_model.",
                vision_scopes=(".visual.", ".visual.merger."), swaps=(kda_swap("Qwen3_5MoeGatedDeltaNet"),),
                model_type_aliases=("qwen3_5_moe_text",))
