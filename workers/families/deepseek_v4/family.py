"""DeepSeek-V4: every layer a MoE layer under manifold-constrained hyper-connections (the residual is `hc_mult`
streams mixed in and out of each block), shared-KV attention with sinks over a sliding window plus compressed
entries (CSA: compressed and indexer-selected, HCA: heavily compressed), and a grouped low-rank output projection.
Its first layers route by a frozen token-id -> expert table (hash MoE), the rest by a bias-corrected top-k; both
routers run unchanged under expert parallelism, as do the compressors and hyper-connections (transformers' code).
The routed experts clamp gate and up at `swiglu_limit` (`experts.limit`)."""

from moetune.api.families import FAMILIES
from moetune.workers.families.spec import Family


def tiny_config(**overrides):
    from transformers import DeepseekV4Config

    values = {"vocab_size": 272, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 16,
              "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
              "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                              "compressed_sparse_attention"],
              "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "hc_mult": 2, "hc_sinkhorn_iters": 3,
              "sliding_window": 8, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 16,
              "index_topk": 4, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
              "swiglu_limit": 0.1}  # small enough that the experts' clamp acts on tiny random weights
    return DeepseekV4Config(**{**values, **overrides})


FAMILY = Family(FAMILIES["deepseek_v4"], moe_block="DeepseekV4SparseMoeBlock", shared_experts="shared_experts",
                tiny_config=tiny_config,
                # PEFT wraps the grouped output projection as a plain Linear, whose LoRA path ignores the groups
                lora_unsupported=("o_a_proj",))
