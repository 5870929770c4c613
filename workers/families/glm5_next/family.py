"""GLM-5-Next: KDA + DSA sparse MLA, sigmoid router with bias correction, a shared expert, SwiGLU with clamping
(`swiglu_limit`), under a vision tower that takes images (workers.methods.multimodal); the tower stays frozen and
without LoRA unless lora.vision says otherwise.
Its indexed attention runs on kernels/sparse_attention (sparse_attention.py) with a query-chunked indexer
(indexer.py)."""

from moetune.api.families import FAMILIES
from moetune.workers.families.glm5_next.sparse_attention import apply_sparse_attention_kernels
from moetune.workers.families.kda import kda_swap
from moetune.workers.families.spec import Family


def tiny_config(**overrides):
    from transformers import Glm5NextConfig

    text = {"vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 4, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 0,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 16, "index_topk": 16, "index_kpool": 4,
            "index_head_dim": 16, "index_n_heads": 2, "linear_head_dim": 16, "linear_num_heads": 4, "hc_mult": 2,
            "pad_token_id": 0, "max_position_embeddings": 512}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    return Glm5NextConfig(text_config={**text, **overrides}, vision_config=vision)


def _gate_lower_bound(layer):
    """Its forget gate is lower_bound · sigmoid(...) where the config sets linear_lower_bound: in [bound, 0)."""
    return layer.forget_gate.safe_gate_lower_bound


FAMILY = Family(FAMILIES["glm5_next"], moe_block="Glm5NextTextMoE", shared_experts="shared_experts",
                tiny_config=tiny_config, auto_class="AutoModelForImageTextToText", lora_scope=".language_model.",
                vision_scopes=(".visual.", ".visual.merger."),
                swaps=(kda_swap("Glm5NextTextLinearAttention", _gate_lower_bound), apply_sparse_attention_kernels),
                model_type_aliases=("glm5_next_text",))
