"""Chunked linear + cross-entropy for any device: the gradient of each chunk is taken in the forward, so a
chunk's logits are freed before the next chunk's exist, and the backward only scales the stored gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# tokens per chunk: its fp32 logits are CHUNK_TOKENS × vocab × 4 bytes (1 GiB at a 131,072 vocabulary)
CHUNK_TOKENS = 2048


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int):
        loss = hidden.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, y = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
            logits = F.linear(h, weight).float()  # the model's dtype, then fp32 as the plain loss does
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            if grad is not None:  # d loss / d logits = softmax - one_hot, then through the linear
                probs = logits.sub_(lse[:, None]).exp_()
                probs[torch.arange(len(y), device=y.device), y] -= 1.0
                grad[start:start + chunk_tokens] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None


def chunked_linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens: int = CHUNK_TOKENS):
    return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens)
