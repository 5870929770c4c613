"""Kimi K2.5's facts: a DeepSeek-V3 text model (MLA + MoE, with its context-parallel path) under a vision tower;
text path only."""

from moetune.workers.families.linears import MLA, MLP, mla_query_absent

FACTS = dict(expert_count_keys=("n_routed_experts",), linear_names=MLA + MLP, text_config_key="text_config",
             absent_linears=mla_query_absent, context_parallel=True)
