"""The output layer and cross-entropy in one, over token chunks: a [tokens, vocab] logits tensor never exists.

`linear_cross_entropy_sum(hidden [N, H], weight [V, H], targets [N])` is the summed cross-entropy of
`hidden @ weight.T` against `targets`, as `F.cross_entropy(F.linear(hidden, weight).float(), targets,
reduction="sum")` computes it. The output weight is frozen (LoRA never adapts it): only `hidden` gets a gradient.
On CUDA it runs Liger's fused linear cross-entropy (Triton); elsewhere `chunked.ChunkedLinearCrossEntropy`.
"""

from moetune.kernels.loss.dispatch import linear_cross_entropy_sum

__all__ = ["linear_cross_entropy_sum"]
