"""A call's sequences as tensors, and their per-token log-probabilities under the model."""

from __future__ import annotations

import torch

from moetune.workers.methods.loss_head import LossHead, linear_token_logprobs, logits_token_logprobs


class TokenLogprobHead(LossHead):
    """The session model's output layer (methods.loss_head): while armed with a batch's tokens it returns each
    token's log-probability given the ones before it, [B, T - 1], instead of [B, T, vocab] logits."""

    def forward(self, hidden):
        if self.labels is None:
            return super().forward(hidden)
        return linear_token_logprobs(hidden[:, :-1], self.weight, self.labels[:, 1:])


def padded_tokens(sequences: list[list[int]], device) -> torch.Tensor:
    width = max(len(s) for s in sequences)
    tokens = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s)
    return tokens.to(device)


def padded(data: list, device) -> dict:
    """Right-padded tokens and per-token tensors; padding and position 0 weigh nothing."""
    width = max(len(d.tokens) for d in data)
    out = {"tokens": padded_tokens([d.tokens for d in data], device)}
    for key, field, default in (("weights", "weights", 1.0), ("advantages", "advantages", 0.0),
                                ("sampler", "logprobs", 0.0)):
        t = torch.zeros((len(data), width))
        for i, d in enumerate(data):
            values = getattr(d, field)
            t[i, : len(d.tokens)] = torch.tensor(values) if values is not None else default
        out[key] = t.to(device)
    out["weights"][:, 0] = 0.0
    return out


def token_logprobs(model, tokens: torch.Tensor, head: TokenLogprobHead | None = None) -> torch.Tensor:
    """[B, T] fp32 log-probability of each token given the ones before it (0 at position 0): from the model's
    TokenLogprobHead where it has one, else from its logits a chunk at a time."""
    if head is not None:
        with head.armed(tokens):
            picked = model(input_ids=tokens).logits
    else:  # the logits of the last position predict nothing: a dummy target, cut (no copy of the logits)
        picked = logits_token_logprobs(model(input_ids=tokens).logits, tokens.roll(-1, dims=1))[:, :-1]
    return torch.nn.functional.pad(picked, (1, 0))
