"""Linear module names of building blocks several families share, for their facts (torch-free: the control plane
reads the facts)."""

MLP = ("gate_proj", "up_proj", "down_proj")  # dense MLPs and shared experts
# Multi-head latent attention (DeepSeek-V3 style)
MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def mla_query_absent(text: dict) -> tuple[str, ...]:
    """MLA's query is one q_proj, or q_a_proj -> q_b_proj with a q_lora_rank: the other names are absent."""
    return ("q_proj",) if text.get("q_lora_rank") else ("q_a_proj", "q_b_proj")


def mla_query_absent_beside_kda(text: dict) -> tuple[str, ...]:
    """The same, where KDA layers have a q_proj of their own."""
    return () if text.get("q_lora_rank") else ("q_a_proj", "q_b_proj")
