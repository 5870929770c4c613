"""Kimi K3 (`kimi_k3`), the seed model, read as released: transformers has no class for it, so moetune defines the
model here (configuration.py, modeling.py) with the release's module names; tests prove it against NeMo
Automodel's reference implementation."""

from moetune.api.families import FAMILIES
from moetune.workers.families.kda import kda_swap
from moetune.workers.families.segments import segment_attention_swap
from moetune.workers.families.spec import Family

# A tiny text model of the released shape: both layer kinds (KDA: 1, 3; MLA: 2, 4 in the release's 1-indexed
# lists), dense layer 0, latent MoE after it, and an Attention-Residual block boundary at layer 2. Widths that the
# MXFP4 groups of 32 divide (latent 32, expert intermediate 32).
TINY_TEXT = {
    "vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "initializer_range": 0.1, "rms_norm_eps": 1e-5,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "routed_expert_hidden_size": 32,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 3],
                           "full_attn_layers": [2, 4], "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    "attn_res_block_size": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def tiny_config(**overrides):
    from moetune.workers.families.kimi_k3.configuration import KimiK3Config

    return KimiK3Config(text_config={**TINY_TEXT, **overrides})


def _register() -> None:
    """transformers' auto classes build moetune's K3 classes from a `kimi_k3` config (the loader, the planner and
    the serving engine build every family through them); importing `modeling` registers the per-expert ->
    fused-experts conversion both loaders read."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from moetune.workers.families.kimi_k3 import configuration, modeling

    AutoConfig.register("kimi_k3", configuration.KimiK3Config, exist_ok=True)
    AutoConfig.register("kimi_k3_text", configuration.KimiK3TextConfig, exist_ok=True)
    AutoModelForImageTextToText.register(configuration.KimiK3Config, modeling.KimiK3ForConditionalGeneration,
                                         exist_ok=True)
    AutoModelForCausalLM.register(configuration.KimiK3TextConfig, modeling.KimiK3ForCausalLM, exist_ok=True)


def expert_activation(experts):
    return experts.act  # SiTU-GLU: beta·tanh(gate/beta)·sigmoid(gate) times the bounded up half


_register()

FAMILY = Family(FAMILIES["kimi_k3"], moe_block="KimiK3MoE", shared_experts="shared_experts",
                tiny_config=tiny_config, auto_class="AutoModelForImageTextToText", lora_scope=".language_model.",
                swaps=(kda_swap("KimiK3DeltaAttention"), segment_attention_swap("KimiK3Attention")),
                model_type_aliases=("kimi_k3_text",), expert_activation=expert_activation,
                # the Attention Residuals' projections: their weight is the mix's pseudo-query, never called
                lora_unsupported=("self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj"))
