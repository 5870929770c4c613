"""Which implementation computes the loss: Liger's fused kernel on CUDA, the chunked one elsewhere."""

from __future__ import annotations

from moetune.kernels.loss.chunked import CHUNK_TOKENS, chunked_linear_cross_entropy_sum


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


def logits_chunk_rows(tokens: int, vocab: int, hidden: int, on_cuda: bool) -> int:
    """Rows of the [rows, vocab] logits linear_cross_entropy_sum holds at once for `tokens` rows (the planner counts
    them): on CUDA Liger's chunk, in the input's dtype, which grows with the tokens (its forward takes the next
    power of two of tokens / ceil(vocab / hidden): 8,192 rows at 128K tokens for Kimi K3, 65,536 at 1M);
    elsewhere CHUNK_TOKENS rows in fp32."""
    if not on_cuda:
        return min(tokens, CHUNK_TOKENS)
    per_row = -(-vocab // hidden)
    return min(tokens, 1 << (-(-tokens // per_row) - 1).bit_length()) if tokens else 0
