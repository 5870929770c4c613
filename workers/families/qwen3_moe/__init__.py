"""Qwen3-MoE: softmax top-k router, routed experts only."""
