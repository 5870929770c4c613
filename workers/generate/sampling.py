"""The next token of every row: greedy at temperature 0, else transformers' temperature and top-p warpers and a
draw from the row's own generator (so a seed gives the same tokens whatever the batch holds)."""

from __future__ import annotations

import secrets

import torch

from moetune.workers.generate.requests import SamplingParams


def row_generator(params: SamplingParams, device) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device=device).manual_seed(seed)


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(params.temperature)(None, logits[None].float())
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))


def next_tokens(logits: torch.Tensor, rows) -> list[int]:
    """logits [rows, vocab] of the last position; each row has `.params` and `.generator`."""
    greedy = logits.argmax(-1).tolist()
    return [g if row.generator is None else _sample(logits[i], row.params, row.generator)
            for i, (g, row) in enumerate(zip(greedy, rows, strict=True))]
