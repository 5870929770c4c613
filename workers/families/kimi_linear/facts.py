"""Kimi-Linear's facts: KDA layers (their own q/k/v and gate projections) beside NoPE MLA full attention, both
with a context-parallel path (workers.families.context)."""

from moetune.workers.families.linears import MLA, MLP, mla_query_absent_beside_kda

FACTS = dict(expert_count_keys=("num_experts", "num_local_experts"),
             linear_names=MLA + MLP + ("k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj"),
             absent_linears=mla_query_absent_beside_kda, context_parallel=True, pipeline=True)
