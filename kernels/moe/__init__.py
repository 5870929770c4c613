"""MoE experts with fused LoRA: grouped GEMM over the local experts, y = xW + s·(xA)B, W frozen, and the expert MLP
built from it. `reference` holds the per-expert loop used as the oracle."""

from moetune.kernels.moe.function import moe_lora_grouped
from moetune.kernels.moe.mlp import moe_lora_mlp

__all__ = ["moe_lora_grouped", "moe_lora_mlp"]
