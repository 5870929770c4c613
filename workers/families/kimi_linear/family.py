from moetune.api.families import FAMILIES
from moetune.workers.families.kda import kda_swap
from moetune.workers.families.kimi_linear.tiny import tiny_config
from moetune.workers.families.segments import segment_attention_swap
from moetune.workers.families.spec import Family

FAMILY = Family(FAMILIES["kimi_linear"], moe_block="KimiLinearMoE", shared_experts="shared_experts",
                tiny_config=tiny_config,
                swaps=(kda_swap("KimiLinearDeltaAttention"), segment_attention_swap("KimiLinearAttention")),
                demo="text")
