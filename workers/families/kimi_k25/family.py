"""Kimi K2.5, text path: a DeepSeek-V3 language model (MLA attention, grouped sigmoid router with bias correction,
shared experts, first layers dense) under a vision tower and projector (`Kimi_K25ForConditionalGeneration`, the
text model under `model.language_model`); the vision side stays frozen and without LoRA. Its releases store the
routed experts as compressed-tensors INT4 (moetune.api.quantization)."""

from moetune.api.families import FAMILIES
from moetune.workers.families.deepseek_v3 import FAMILY as DEEPSEEK_V3
from moetune.workers.families.deepseek_v3 import tiny_config as deepseek_v3_tiny_config
from moetune.workers.families.spec import Family


def tiny_config(**overrides):
    from transformers import Kimi_K25Config

    vision = {"patch_size": 4, "pos_emb_height": 4, "pos_emb_width": 4, "num_attention_heads": 2,
              "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}
    return Kimi_K25Config(text_config=deepseek_v3_tiny_config(**overrides).to_dict(), vision_config=vision,
                          projection_hidden_size=32, tie_word_embeddings=False)


FAMILY = Family(FAMILIES["kimi_k25"], moe_block="DeepseekV3MoE", shared_experts="shared_experts",
                tiny_config=tiny_config, auto_class="AutoModelForImageTextToText", lora_scope=".language_model.",
                swaps=DEEPSEEK_V3.swaps)
