from moetune.api.families import FAMILIES
from moetune.workers.families.kda import kda_swap
from moetune.workers.families.qwen3_next.tiny import tiny_config
from moetune.workers.families.spec import Family

FAMILY = Family(FAMILIES["qwen3_next"], moe_block="Qwen3NextSparseMoeBlock", shared_experts="shared_expert",
                tiny_config=tiny_config, swaps=(kda_swap("Qwen3NextGatedDeltaNet"),))
