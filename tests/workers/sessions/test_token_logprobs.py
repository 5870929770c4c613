"""A session's per-token log-probabilities without [tokens, vocab] fp32 logits (methods.loss_head's chunked
`linear_token_logprobs` / `logits_token_logprobs`, the session's TokenLogprobHead) equal the full formula they
replace, `log_softmax(logits.float()).gather(targets)`, in value and in gradient: chunks of a few tokens here, so
that every chunk boundary is crossed; the tiny model in fp32 with LoRA, its output layer swapped, end to end.

Sabotage noted: the backward's gradient without its per-row scale (grad_out ignored) fails the gradient checks; the
linear path's log-sum-exp without the chunk's max added back fails its value checks and the model's."""

import copy

import pytest
import torch
import torch.nn.functional as F

from moetune.workers.methods.loss_head import install_loss_head, linear_token_logprobs, logits_token_logprobs
from moetune.workers.sessions.batch import TokenLogprobHead, padded_tokens, token_logprobs

TOKENS = [[5, 17, 33, 48, 62, 71, 90, 3, 44], [9, 8, 7, 6], [1, 2]]


def full_formula(logits, targets):
    """The computation the chunked ones replace."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def nonlinear(logprobs):
    """A loss whose gradient weighs every token differently (as PPO's or a custom loss does)."""
    weights = torch.linspace(-1.0, 2.0, logprobs.numel()).view(logprobs.shape)
    return (weights * logprobs).sum() + logprobs.exp().sum()


@pytest.mark.parametrize("chunk_tokens", [1, 4, 64])
def test_linear_token_logprobs_equal_the_full_formula(chunk_tokens):
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16)
    targets = torch.randint(0, 50, (3, 7))
    want = full_formula(F.linear(hidden, weight), targets)
    want_grad, = torch.autograd.grad(nonlinear(want), hidden)
    got = linear_token_logprobs(hidden, weight, targets, chunk_tokens)
    got_grad, = torch.autograd.grad(nonlinear(got), hidden)
    assert got.dtype == torch.float32 and got.shape == targets.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # a forward call: no gradient is taken in the forward either
        torch.testing.assert_close(linear_token_logprobs(hidden, weight, targets, chunk_tokens), want.detach(),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 64])
def test_logits_token_logprobs_equal_the_full_formula(chunk_tokens):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    want = full_formula(logits, targets)
    want_grad, = torch.autograd.grad(nonlinear(want), logits)
    got = logits_token_logprobs(logits, targets, chunk_tokens)
    got_grad, = torch.autograd.grad(nonlinear(got), logits)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def _old_token_logprobs(model, tokens):
    """workers/sessions/batch.py's token_logprobs before the chunked head."""
    logits = model(input_ids=tokens).logits[:, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return F.pad(picked, (1, 0))


def _logprobs_and_lora_grads(model, compute):
    tokens = padded_tokens(TOKENS, "cpu")
    logprobs = compute(model, tokens)
    nonlinear(logprobs[:, 1:]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return logprobs.detach(), grads


def test_the_sessions_logprobs_and_lora_gradients_equal_the_full_logits_ones(model):
    headed = copy.deepcopy(model)
    head = install_loss_head(headed, TokenLogprobHead)
    assert isinstance(head, TokenLogprobHead)
    want, want_grads = _logprobs_and_lora_grads(model, _old_token_logprobs)
    for name, compute in (("head", lambda m, t: token_logprobs(m, t, head)),
                          ("logits", lambda m, t: token_logprobs(m, t))):
        got, grads = _logprobs_and_lora_grads(headed if name == "head" else model, compute)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        assert grads.keys() == want_grads.keys() and len(grads) > 4
        for param, grad in grads.items():
            scale = float(want_grads[param].abs().max())
            assert scale > 0, param
            torch.testing.assert_close(grad, want_grads[param], rtol=1e-4, atol=1e-6 * scale, msg=f"{name} {param}")
    with torch.no_grad():  # unarmed, the head is the plain output layer: generation sees the same logits
        tokens = padded_tokens(TOKENS, "cpu")
        torch.testing.assert_close(headed(input_ids=tokens).logits, model(input_ids=tokens).logits)
