from moetune.api.families import FAMILIES
from moetune.workers.families.kda import kda_swap
from moetune.workers.families.qwen3_5_moe.mrope import batch_rope_index
from moetune.workers.families.qwen3_5_moe.tiny import TINY_VISION, tiny_config
from moetune.workers.families.spec import Family

FAMILY = Family(FAMILIES["qwen3_5_moe"], moe_block="Qwen3_5MoeSparseMoeBlock", shared_experts="shared_expert",
                tiny_config=tiny_config, auto_class="AutoModelForImageTextToText", lora_scope=".language_model.",
                vision_scopes=(".visual.", ".visual.merger."),
                swaps=(kda_swap("Qwen3_5MoeGatedDeltaNet"), batch_rope_index),
                model_type_aliases=("qwen3_5_moe_text",), tiny_vision=TINY_VISION, demo="images")
