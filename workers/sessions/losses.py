"""The losses of forward_backward over per-token log-probabilities, each summed over the tokens it counts (the
session's caller normalizes, as Tinker's losses do). Entry t of a per-token tensor is about predicting token t.
`clip` is the ratio's (low, high) bounds, for the losses that clip it."""

from __future__ import annotations

import torch


def cross_entropy(logprobs, weights, advantages, sampler_logprobs, clip):
    return -(weights * logprobs).sum()


def importance_sampling(logprobs, weights, advantages, sampler_logprobs, clip):
    """REINFORCE on samples drawn by another policy (the sampler's log-probabilities), reweighted by the ratio."""
    ratio = torch.exp(logprobs - sampler_logprobs)
    return -(weights * ratio * advantages).sum()


def ppo(logprobs, weights, advantages, sampler_logprobs, clip):
    """PPO's clipped surrogate: the ratio cannot pull the loss beyond [low, high] times the advantage."""
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, *clip)
    return -(weights * torch.minimum(ratio * advantages, clipped * advantages)).sum()


def cispo(logprobs, weights, advantages, sampler_logprobs, clip):
    """CISPO: the clipped ratio is a constant weight on the policy gradient (every token keeps its gradient)."""
    ratio = torch.exp(logprobs - sampler_logprobs).detach()
    return -(weights * torch.clamp(ratio, *clip) * advantages * logprobs).sum()


LOSSES = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo, "cispo": cispo}
