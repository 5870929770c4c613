"""Each family's tiny random model as the EP, LoRA and adapter tests build it, and their deterministic batches."""

from __future__ import annotations

import torch


def plain_model(family, seed: int = 0, skew_to_first_half: bool = False, config=None):
    """The family's tiny random model with a spread-out router (a zero router routes uniformly).

    Expert biases, where a family has them, are random too. `skew_to_first_half` routes every token to the first
    half of the experts through the router's score correction bias (kimi_linear, deepseek_v3): with EP=2, rank 1's
    experts get no token at all. `config`: another config of the family (the tiny one by default).
    """
    from moetune.workers.families import auto_model_class

    torch.manual_seed(seed)
    config = config or family.tiny_config()
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for _, block in family.moe_blocks(model):
            router = getattr(block, family.router)
            router.weight.normal_(0.0, 0.5)
            for name, param in getattr(block, family.experts).named_parameters():
                if name.endswith("_bias"):  # biased experts (gpt-oss) initialise them to zero
                    param.normal_(0.0, 0.1)
            if hasattr(router, "tid2eid"):  # hash routing (deepseek_v4): each token id its own distinct experts
                table = torch.rand(router.tid2eid.shape[0], router.num_experts).argsort(-1)[:, :router.top_k]
                router.tid2eid.copy_(table)
            if skew_to_first_half:
                half = router.e_score_correction_bias.numel() // 2
                router.e_score_correction_bias[:half] = 100.0
    return model


def batch(rank: int, step: int, micro: int = 2, seq: int = 12, vocab: int = 256) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (micro, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


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
