"""Qwen3-MoE's facts."""

from moetune.workers.families.linears import MLP


def absent_linears(text: dict) -> tuple[str, ...]:
    """No shared experts: its MLP projections exist only in dense layers (`mlp_only_layers`, or those
    `decoder_sparse_step` skips), as transformers' Qwen3MoeDecoderLayer builds them."""
    dense = text.get("mlp_only_layers") or (text.get("decoder_sparse_step") or 1) > 1 or text.get("num_experts") == 0
    return () if dense else MLP


FACTS = dict(expert_count_keys=("num_experts", "num_local_experts"),
             linear_names=("q_proj", "k_proj", "v_proj", "o_proj") + MLP, absent_linears=absent_linears,
             pipeline=True)
