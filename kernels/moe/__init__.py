"""MoE experts with fused LoRA: grouped GEMM over the local experts, y = xW + s·(xA)B, W frozen.
`reference` holds the per-expert loop used as the oracle."""

from kernels.moe.function import moe_lora_grouped

__all__ = ["moe_lora_grouped"]
