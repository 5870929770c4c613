"""The model's output layer, which, while a micro-batch's labels are armed, returns that micro-batch's summed
next-token cross-entropy instead of logits (kernels.loss: no [tokens, vocab] tensor), and only over the positions
that carry loss. It runs inside the model's forward, where ZeRO-3 has gathered its weight; unarmed (evaluation
harnesses, generation) it is the plain linear.

Per-token log-probabilities (training sessions, and DPO's fallback for an output layer that is no plain linear)
come from `linear_token_logprobs` or `logits_token_logprobs`, a chunk of tokens at a time: no fp32 [tokens, vocab]
tensor and no full log_softmax exist. Measured on CPU at K3's 163,840 vocabulary, forward and backward: the full
formula took 10.5 GB above its inputs at 4K tokens (growing with the tokens), these 1.3 GB at 8K (one chunk)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from moetune.kernels.loss import linear_cross_entropy_sum
from moetune.kernels.loss.chunked import CHUNK_TOKENS
from moetune.workers.methods.batch import IGNORE


class _LinearTokenLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[row, target] per row. A row's log-probability depends on that row of hidden
    only, so its gradient is one vector per row, weight[target] - softmax @ weight: taken in the forward, chunk by
    chunk (as kernels.loss does; the weight, which ZeRO-3 gathers for the forward only, is frozen and not needed
    in the backward), then scaled by each row's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            y = targets[rows]
            logits = F.linear(hidden[rows], weight).float()  # the model's dtype, then fp32, as the logits path
            picked = logits.gather(1, y[:, None])[:, 0]
            top = logits.max(dim=-1).values
            exps = logits.sub_(top[:, None]).exp_()  # in place: one [chunk, vocab] fp32 buffer, no temporaries
            total = exps.sum(dim=-1)
            out[rows] = picked - top - total.log()
            if grad is not None:  # d out / d logits = one_hot - softmax (in the same buffer), through the linear
                exps.div_(total[:, None]).neg_()[torch.arange(len(y), device=y.device), y] += 1.0
                grad[rows] = (exps.to(weight.dtype) @ weight).to(hidden.dtype)
            del logits, exps  # before the next chunk's exist
        ctx.save_for_backward(grad)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return (grad.float() * grad_out[:, None]).to(grad.dtype), None, None, None


class _LogitsTokenLogprobs(torch.autograd.Function):
    """log_softmax(logits.float())[row, target] per row, a chunk of rows in fp32 at a time; the backward
    recomputes each chunk's softmax from the logits (the model's output, kept anyway) and its log-sum-exp."""

    @staticmethod
    def forward(ctx, logits, targets, chunk_tokens: int):
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk = logits[rows].float()
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            out[rows] = chunk.gather(1, targets[rows, None])[:, 0] - lse[rows]
            del chunk
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            y = targets[rows]
            minus_probs = logits[rows].to(torch.float32, copy=True)  # a copy: the saved logits stay as they are
            minus_probs.sub_(lse[rows, None]).exp_().neg_()
            minus_probs[torch.arange(len(y), device=y.device), y] += 1.0
            grad[rows] = minus_probs.mul_(grad_out[rows, None]).to(logits.dtype)
            del minus_probs
        return grad, None, None


def linear_token_logprobs(hidden, weight, targets, chunk_tokens: int = CHUNK_TOKENS):
    """[...] fp32 log-probability of each target under `hidden [..., H] @ weight.T` (a frozen weight): what
    `log_softmax(F.linear(hidden, weight).float(), -1).gather(-1, targets[..., None])` gives."""
    flat = _LinearTokenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                      chunk_tokens)
    return flat.view(targets.shape)


def logits_token_logprobs(logits, targets, chunk_tokens: int = CHUNK_TOKENS):
    """[...] fp32 log-probability of each target under `logits [..., V]`: `log_softmax(logits.float(), -1)`'s
    entry, without its [tokens, vocab] fp32 tensors."""
    flat = _LogitsTokenLogprobs.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), chunk_tokens)
    return flat.view(targets.shape)


class LossHead(torch.nn.Module):
    per_sequence = False  # the loss runs once for the micro-batch's tokens (the planner sizes its logits chunk so)

    def __init__(self, head: torch.nn.Linear):
        super().__init__()
        self.weight = head.weight  # the same Parameter: a tie to the input embeddings stays
        self.labels = None

    def forward(self, hidden):
        if self.labels is None:
            return F.linear(hidden, self.weight)
        # the model shifts nothing here: position t predicts label t+1, for every position with a label after it
        # (all of them in a context-parallel slice, whose labels run one token past it: methods.context_cut)
        targets = self.labels[:, 1:]
        keep = targets.flatten() != IGNORE
        scored = hidden[:, :targets.shape[1]].flatten(0, 1)
        return linear_cross_entropy_sum(scored[keep], self.weight, targets.flatten()[keep])

    @contextlib.contextmanager
    def armed(self, labels):
        self.labels = labels
        try:
            yield
        finally:
            self.labels = None


def install_loss_head(model, head_class: type[LossHead] = LossHead) -> LossHead | None:
    """Replaces a transformers model's (PEFT-wrapped too) bias-free output linear by a LossHead (or the method's
    subclass of it); None when it has another output layer (the loss then takes the logits)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    name = next(n for n, m in model.named_modules() if m is head)
    parent, _, leaf = name.rpartition(".")
    loss_head = head_class(head)
    setattr(model.get_submodule(parent), leaf, loss_head)
    return loss_head
