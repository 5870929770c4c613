from moetune.api.families import FAMILIES
from moetune.workers.families.deepseek_v32.dsa import apply_dsa_kernels
from moetune.workers.families.deepseek_v32.tiny import tiny_config
from moetune.workers.families.spec import Family

FAMILY = Family(FAMILIES["deepseek_v32"], moe_block="DeepseekV32MoE", shared_experts="shared_experts",
                tiny_config=tiny_config, swaps=(apply_dsa_kernels,))
