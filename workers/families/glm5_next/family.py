from moetune.api.families import FAMILIES
from moetune.workers.families.glm5_next.sparse_attention import apply_sparse_attention_kernels
from moetune.workers.families.glm5_next.tiny import TINY_VISION, tiny_config
from moetune.workers.families.kda import kda_swap
from moetune.workers.families.spec import Family


def _gate_lower_bound(layer):
    """Its forget gate is lower_bound · sigmoid(...) where the config sets linear_lower_bound: in [bound, 0)."""
    return layer.forget_gate.safe_gate_lower_bound


FAMILY = Family(FAMILIES["glm5_next"], moe_block="Glm5NextTextMoE", shared_experts="shared_experts",
                tiny_config=tiny_config, auto_class="AutoModelForImageTextToText", lora_scope=".language_model.",
                vision_scopes=(".visual.", ".visual.merger."),
                swaps=(kda_swap("Glm5NextTextLinearAttention", _gate_lower_bound), apply_sparse_attention_kernels),
                model_type_aliases=("glm5_next_text",), tiny_vision=TINY_VISION)
