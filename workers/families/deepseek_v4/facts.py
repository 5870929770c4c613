"""DeepSeek-V4's facts: shared-KV attention (q_a/q_b, kv, grouped o_a -> o_b; PEFT cannot adapt the grouped o_a_proj)
whose compressors and indexer have their own kv/gate projections; shared and routed experts (every layer MoE)."""

from moetune.workers.families.linears import MLP

FACTS = dict(expert_count_keys=("n_routed_experts",),
             linear_names=("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "weights_proj") + MLP)
