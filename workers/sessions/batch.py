"""A call's sequences as tensors, and their per-token log-probabilities under the model."""

from __future__ import annotations

import torch


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


def token_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probability of each token given the ones before it (0 at position 0)."""
    logits = model(input_ids=tokens).logits[:, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked, (1, 0))
