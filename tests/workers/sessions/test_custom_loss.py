"""forward_backward_custom without Ray: the SDK's side (moetune.api.custom_loss, the user's loss on a forward's
logprobs, its gradient turned into weights) and the workers' side (the session's batch, logprobs and cross_entropy
surrogate, workers/sessions) on the tiny model with LoRA in one process. The surrogate's LoRA gradients must equal
those of autograd through the user's loss applied to the model's logprobs directly.

Sabotage noted: weights = +gradient (the sign dropped) fails the gradient check, and so does a loss over all but the
last token of each sequence on the SDK side."""

import pytest
import torch

from moetune.api.custom_loss import surrogate_weights
from moetune.api.models.training_sessions import Datum
from moetune.workers.sessions.batch import padded, token_logprobs
from moetune.workers.sessions.losses import LOSSES

DATA = [Datum(tokens=[5, 17, 33, 48, 62, 71, 90], advantages=[0.0, 1.0, -0.5, 2.0, 0.3, -1.0, 0.7]),
        Datum(tokens=[9, 8, 7, 6], advantages=[0.0, -1.5, 0.2, 1.0])]


def user_loss(data, logprobs):
    """Not linear in the logprobs, and it mixes the sequences: a softmax over their total logprobs, advantages
    squared per sequence."""
    totals = torch.stack([lp[1:].sum() for lp in logprobs])
    weighted = torch.stack([(lp * torch.tensor(d.advantages)).sum() for d, lp in zip(data, logprobs)])
    return -torch.logsumexp(totals, 0) + 0.1 * (weighted**2).sum(), {"sequences": len(data)}


def _lora_grads(model) -> dict:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def test_the_surrogate_gives_the_gradient_of_the_users_loss(model):
    tokens = padded(DATA, "cpu")["tokens"]
    logprobs = token_logprobs(model, tokens)
    direct_loss, _ = user_loss(DATA, [lp[: len(d.tokens)] for lp, d in zip(logprobs, DATA)])
    direct_loss.backward()
    want = _lora_grads(model)

    with torch.no_grad():  # the session's forward call: logprobs as the SDK receives them
        returned = [lp[: len(d.tokens)].tolist() for lp, d in zip(token_logprobs(model, tokens), DATA)]
    loss, metrics, weights = surrogate_weights(DATA, returned, user_loss)
    assert loss == pytest.approx(direct_loss.item(), rel=1e-6) and metrics == {"sequences": 2.0}
    assert [len(w) for w in weights] == [len(d.tokens) for d in DATA]
    batch = padded([d.model_copy(update={"weights": w}) for d, w in zip(DATA, weights)], "cpu")
    surrogate = LOSSES["cross_entropy"](token_logprobs(model, batch["tokens"]), batch["weights"],
                                        batch["advantages"], batch["sampler"], 0.2)
    surrogate.backward()
    got = _lora_grads(model)

    assert got.keys() == want.keys() and len(want) > 4
    for name, grad in got.items():
        scale = float(want[name].abs().max())
        assert scale > 0, name
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_a_loss_that_is_not_a_scalar_or_has_no_finite_gradient_is_refused():
    logprobs = [[0.0] * len(d.tokens) for d in DATA]
    with pytest.raises(ValueError, match=r"one-element tensor.*Tensor\(7,\)"):
        surrogate_weights(DATA, logprobs, lambda data, lps: lps[0])
    with pytest.raises(ValueError, match=r"data\[1\]: the loss' gradient"):
        surrogate_weights(DATA, logprobs, lambda data, lps: lps[0].sum() + lps[1].sqrt().sum() * -1)
