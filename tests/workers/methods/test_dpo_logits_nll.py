"""DPO's fallback for an output layer that is no plain linear (`_logits_nll`, each sequence's summed cross-entropy
from the logits) takes the chunked fp32 path of methods.loss_head, and equals the full-vocabulary cross-entropy it
replaced, value and gradient, ignored labels included, padded and packed.

Sabotage noted: dropping the `* kept` mask (ignored positions counted) fails both cases."""

import pytest
import torch
import torch.nn.functional as F

from moetune.workers.methods.batch import IGNORE
from moetune.workers.methods.dpo import _logits_nll


def _old_logits_nll(logits, labels, sequence_of, sequences: int):
    """dpo.py's `_logits_nll` before the chunked path."""
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE,
                          reduction="none")
    return nll.new_zeros(sequences).index_add(0, sequence_of, nll)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_chunked_fallback_equals_the_full_cross_entropy(layout):
    torch.manual_seed(0)
    rows, width = (4, 9) if layout == "padded" else (1, 30)
    logits = torch.randn(rows, width, 40, requires_grad=True)
    labels = torch.randint(0, 40, (rows, width))
    labels[torch.rand(rows, width) < 0.3] = IGNORE  # prompts and padding carry no loss
    if layout == "padded":
        sequence_of, sequences = torch.arange(rows).repeat_interleave(width - 1), rows
    else:  # segments of 10, 12 and 8 tokens; position t belongs to the segment of token t + 1
        sequence_of, sequences = torch.arange(3).repeat_interleave(torch.tensor([10, 12, 8]))[1:], 3
    scale = torch.tensor([1.0, -2.0, 0.5, 3.0])[:sequences]  # each sequence's gradient its own weight
    want = _old_logits_nll(logits, labels, sequence_of, sequences)
    want_grad, = torch.autograd.grad((want * scale).sum(), logits)
    got = _logits_nll(logits, labels, sequence_of, sequences)
    got_grad, = torch.autograd.grad((got * scale).sum(), logits)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
