"""The Kimi-K2 release's config.json around a tiny DeepSeek-V3's sizes (the family tiny models themselves:
bench.support.tiny_models)."""

from __future__ import annotations


# Fields of Moonshot's Kimi-K2 / K2-Thinking config.json beyond the sizes (the release's own file: model_type
# kimi_k2 with DeepSeek-V3's architecture and remote code, yarn rope as transformers 4.x wrote it)
KIMI_K2_RELEASE = {
    "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "ep_size": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
    "scoring_func": "sigmoid", "seq_aux": True, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 128, "type": "yarn"},
    "torch_dtype": "bfloat16", "transformers_version": "4.48.3",
}


def kimi_k2_release_config(deepseek_v3: dict) -> dict:
    """A transformers DeepseekV3 config.json (a tiny one's sizes) as the Kimi-K2 release writes its own."""
    sizes = {k: v for k, v in deepseek_v3.items() if k not in ("rope_parameters", "dtype", "architectures")}
    return {**sizes, **KIMI_K2_RELEASE}
