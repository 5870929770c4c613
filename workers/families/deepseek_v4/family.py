from moetune.api.families import FAMILIES
from moetune.workers.families.deepseek_v4.tiny import tiny_config
from moetune.workers.families.spec import Family

FAMILY = Family(FAMILIES["deepseek_v4"], moe_block="DeepseekV4SparseMoeBlock", shared_experts="shared_experts",
                tiny_config=tiny_config,
                # PEFT wraps the grouped output projection as a plain Linear, whose LoRA path ignores the groups
                lora_unsupported=("o_a_proj",))
