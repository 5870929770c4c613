"""A call's sequences as tensors, and their per-token log-probabilities under the model."""

from __future__ import annotations

import contextlib

import torch

from moetune.workers.methods.loss_head import LossHead, linear_token_logprobs, logits_token_logprobs


class TokenLogprobHead(LossHead):
    """The session model's output layer (methods.loss_head): while armed with a batch's tokens it returns each
    token's log-probability given the ones before it, [B, T - 1], instead of [B, T, vocab] logits. Unarmed, with
    `top_k` set (a sample call's), only the k likeliest tokens keep finite logits."""

    top_k: int | None = None

    def forward(self, hidden):
        if self.labels is None:
            logits = super().forward(hidden)
            if self.top_k:
                kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            return logits
        return linear_token_logprobs(hidden[:, :-1], self.weight, self.labels[:, 1:])

    @contextlib.contextmanager
    def keeping_top(self, k: int | None):
        self.top_k = k
        try:
            yield
        finally:
            self.top_k = None


def padded_tokens(sequences: list[list[int]], device) -> torch.Tensor:
    width = max(len(s) for s in sequences)
    tokens = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s)
    return tokens.to(device)


def padded(data: list, device) -> dict:
    """Right-padded tokens, their targets (the tokens unless a datum names others) and per-token tensors; padding
    and position 0 weigh nothing."""
    width = max(len(d.tokens) for d in data)
    out = {"tokens": padded_tokens([d.tokens for d in data], device),
           "targets": padded_tokens([d.targets or d.tokens for d in data], device)}
    for key, field, default in (("weights", "weights", 1.0), ("advantages", "advantages", 0.0),
                                ("sampler", "logprobs", 0.0)):
        t = torch.zeros((len(data), width))
        for i, d in enumerate(data):
            values = getattr(d, field)
            t[i, : len(d.tokens)] = torch.tensor(values) if values is not None else default
        out[key] = t.to(device)
    out["weights"][:, 0] = 0.0
    return out


def token_logprobs(model, tokens: torch.Tensor, head: TokenLogprobHead | None = None,
                   targets: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] fp32 log-probability of each target (default: each token) given the tokens before it (0 at position
    0): from the model's TokenLogprobHead where it has one, else from its logits a chunk at a time."""
    targets = tokens if targets is None else targets
    if head is not None:
        with head.armed(targets):
            picked = model(input_ids=tokens).logits
    else:  # the logits of the last position predict nothing: a dummy target, cut (no copy of the logits)
        picked = logits_token_logprobs(model(input_ids=tokens).logits, targets.roll(-1, dims=1))[:, :-1]
    return torch.nn.functional.pad(picked, (1, 0))
