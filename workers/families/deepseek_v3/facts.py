"""DeepSeek-V3's facts. Kimi-K2 / K2-Thinking ship its architecture as model_type "kimi_k2" (their remote code is
DeepseekV3ForCausalLM; transformers reads that name only inside Kimi K2.5's text_config). Its MLA has a
context-parallel path: the rope keys are made from the slice's global positions before they are gathered."""

from moetune.workers.families.linears import MLA, MLP, mla_query_absent

FACTS = dict(expert_count_keys=("n_routed_experts",), linear_names=MLA + MLP, absent_linears=mla_query_absent,
             release_model_types=("kimi_k2",), context_parallel=True)
