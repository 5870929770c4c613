from moetune.api.families import FAMILIES
from moetune.workers.families.deepseek_v3.tiny import tiny_config
from moetune.workers.families.segments import segment_attention_swap
from moetune.workers.families.spec import Family

FAMILY = Family(FAMILIES["deepseek_v3"], moe_block="DeepseekV3MoE", shared_experts="shared_experts",
                tiny_config=tiny_config, swaps=(segment_attention_swap("DeepseekV3Attention"),))
