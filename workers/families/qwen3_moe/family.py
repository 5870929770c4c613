from moetune.api.families import FAMILIES
from moetune.workers.families.qwen3_moe.tiny import tiny_config
from moetune.workers.families.spec import Family

FAMILY = Family(FAMILIES["qwen3_moe"], moe_block="Qwen3MoeSparseMoeBlock", shared_experts=None,
                tiny_config=tiny_config)
