"""DeepSeek-V3.2's facts: DeepSeek-V3's plus the DSA indexer's own linears."""

from moetune.workers.families.linears import MLA, MLP, mla_query_absent

FACTS = dict(expert_count_keys=("n_routed_experts",), linear_names=MLA + MLP + ("wq_b", "wk", "weights_proj"),
             absent_linears=mla_query_absent)
