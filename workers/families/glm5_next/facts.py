"""GLM-5-Next's facts: KDA + DSA sparse MLA (its indexer's wq_b / wk / weights_proj) under a vision tower (frozen);
image rows go through its image processor. Both layer kinds have a context-parallel path."""

from moetune.workers.families.linears import MLA, MLP, mla_query_absent_beside_kda

FACTS = dict(expert_count_keys=("n_routed_experts",),
             linear_names=MLA + MLP + ("k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
                                       "wq_b", "wk", "weights_proj"),
             text_config_key="text_config", images=True, absent_linears=mla_query_absent_beside_kda,
             context_parallel=True)
