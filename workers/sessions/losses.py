"""The losses of forward_backward over per-token log-probabilities, each summed over the tokens it counts (the
session's caller normalizes, as Tinker's losses do). Entry t of a per-token tensor is about predicting token t."""

from __future__ import annotations

import torch


def cross_entropy(logprobs, weights, advantages, sampler_logprobs, clip_epsilon):
    return -(weights * logprobs).sum()


def importance_sampling(logprobs, weights, advantages, sampler_logprobs, clip_epsilon):
    """REINFORCE on samples drawn by another policy (the sampler's log-probabilities), reweighted by the ratio."""
    ratio = torch.exp(logprobs - sampler_logprobs)
    return -(weights * ratio * advantages).sum()


def ppo(logprobs, weights, advantages, sampler_logprobs, clip_epsilon):
    """PPO's clipped surrogate: the ratio cannot pull the loss beyond [1 - e, 1 + e] times the advantage."""
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, 1 - clip_epsilon, 1 + clip_epsilon)
    return -(weights * torch.minimum(ratio * advantages, clipped * advantages)).sum()


LOSSES = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo}
