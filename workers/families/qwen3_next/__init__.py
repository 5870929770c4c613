"""Qwen3-Next: gated DeltaNet (on `kernels.kda`, workers.families.kda) + gated attention, softmax router, a
sigmoid-gated shared expert."""
