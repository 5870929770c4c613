"""A user's own loss on a session's per-token log-probabilities, run on the client (forward_backward_custom), as
Tinker's forward_backward_custom does: the workers never see the function, only its gradient.

The loss L(logp) is evaluated with autograd on the logprobs a forward returned; its gradient g_t = dL/dlogp_t is
then sent as the weights of the linear surrogate cross_entropy computes, -sum_t w_t * logp_t, with w_t = -g_t. Its
gradient with respect to the LoRA weights is sum_t g_t * dlogp_t/dθ = dL/dθ (chain rule), exactly the user's loss'.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from moetune.api.models.training_sessions import Datum

CustomLoss = Callable[[list[Datum], list[torch.Tensor]], Any]  # -> loss, or (loss, {metric: value})


def surrogate_weights(data: list[Datum], logprobs: list[list[float]], loss_fn: CustomLoss
                      ) -> tuple[float, dict[str, float], list[list[float]]]:
    """The user's loss and metrics at `logprobs` (one list per datum, one entry per token, as forward returns
    them), and per datum the weights that make cross_entropy's gradient the loss' gradient."""
    tensors = [torch.tensor(lp, dtype=torch.float32, requires_grad=True) for lp in logprobs]
    out = loss_fn(data, tensors)
    loss, metrics = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a one-element tensor (or it and a dict of metrics), got "
                         f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    grads = torch.autograd.grad(loss.reshape(()), tensors, allow_unused=True)
    weights = []
    for i, (datum, grad) in enumerate(zip(data, grads)):
        w = [0.0] * len(datum.tokens) if grad is None else (-grad).tolist()
        if not all(math.isfinite(x) for x in w):
            raise ValueError(f"data[{i}]: the loss' gradient with respect to its logprobs is not finite")
        weights.append(w)
    return loss.item(), {k: float(v) for k, v in metrics.items()}, weights
