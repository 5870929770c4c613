from moetune.api.families import FAMILIES
from moetune.workers.families.kimi_k25.tiny import tiny_config
from moetune.workers.families.segments import segment_attention_swap
from moetune.workers.families.spec import Family

FAMILY = Family(FAMILIES["kimi_k25"], moe_block="DeepseekV3MoE", shared_experts="shared_experts",
                tiny_config=tiny_config, auto_class="AutoModelForImageTextToText", lora_scope=".language_model.",
                swaps=(segment_attention_swap("DeepseekV3Attention"),))  # its text model's attention
