"""Which implementation computes the loss: Liger's fused kernel on CUDA, the chunked one elsewhere."""

from __future__ import annotations

from moetune.kernels.loss.chunked import chunked_linear_cross_entropy_sum


def _liger_sum(hidden, weight, targets):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    # positional: input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction
    loss, _, _ = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, targets, None, None, -100, 0.0, 0.0,
                                                           "sum")
    return loss


def linear_cross_entropy_sum(hidden, weight, targets):
    """Summed cross-entropy of `hidden @ weight.T` (see the package docstring); targets hold no ignored index."""
    if hidden.is_cuda and hidden.shape[0]:  # a micro-batch without a loss token takes the (empty) chunk loop
        return _liger_sum(hidden, weight, targets)
    return chunked_linear_cross_entropy_sum(hidden, weight, targets)
