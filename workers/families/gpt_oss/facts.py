"""gpt-oss's facts: every layer is MoE (no dense MLP); the router is not a linear; experts carry biases."""

FACTS = dict(expert_count_keys=("num_local_experts",), linear_names=("q_proj", "k_proj", "v_proj", "o_proj"))
