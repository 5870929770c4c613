"""One batch of rows decoded together: every decode step runs all rows in one forward (left-padded KV, per-row
positions, per-row adapter slots). The engine's loop prefills each arriving row alone and joins its cache to the
batch (workers.generate.cache); `generate_batch` (evaluation on training workers) prefills all its prompts in one
left-padded forward: under ZeRO-3 each forward gathers every layer's weights, so one prefill per prompt cost a full
gather per prompt."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moetune.workers.generate import cache as batch_cache
from moetune.workers.generate.requests import SamplingParams
from moetune.workers.generate.sampling import next_tokens, row_generator
from moetune.workers.lora.row_slots import RowSelection


@dataclass(eq=False)
class Row:
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    slot: int = 0  # adapter slot (0: the base)
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    length: int = 0  # tokens in the cache (its next position id)
    pad: int = 0  # left padding of its KV in the batch
    finish_reason: str | None = None
    last: int | None = None  # the token the next decode step feeds (a stop token too, in lockstep)

    def take(self, token: int) -> bool:
        """Records a generated token; True when the row is finished (a stop token is not kept)."""
        self.last = token
        if token in self.stop_ids:
            self.finish_reason = "stop"
        else:
            self.tokens.append(token)
            if len(self.tokens) >= self.params.max_new_tokens:
                self.finish_reason = "length"
        return self.finish_reason is not None


class DecodeBatch:
    def __init__(self, model, selection: RowSelection | None = None):
        self.model, self.selection = model, selection
        self.device = next(model.parameters()).device
        self.rows: list[Row] = []
        self.cache = None
        self.steps = 0

    def _forward(self, input_ids, cache, rows: list[Row], **kwargs):
        if self.selection is not None:
            self.selection.set([r.slot for r in rows], self.device)
        out = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[:, -1]

    def prefill(self, row: Row):
        """Runs `row`'s prompt alone; returns (its first token, its one-row cache) for `join`."""
        cache = batch_cache.new_cache(self.model)
        ids = torch.tensor([row.prompt_ids], dtype=torch.long, device=self.device)
        logits = self._forward(ids, cache, [row])
        row.length = len(row.prompt_ids)
        return next_tokens(logits, [row])[0], cache

    def prefill_all(self, rows: list[Row]) -> list[int]:
        """Starts an empty batch with `rows`, their prompts in one forward, left-padded to the longest (the padding
        masked out, each row at its own positions); returns each row's first token."""
        longest = max(len(r.prompt_ids) for r in rows)
        for r in rows:
            r.pad, r.length = longest - len(r.prompt_ids), len(r.prompt_ids)
        ids = torch.tensor([[0] * r.pad + r.prompt_ids for r in rows], dtype=torch.long, device=self.device)
        mask = padding_mask([r.pad for r in rows], longest, self.device)
        self.rows, self.cache = list(rows), batch_cache.new_cache(self.model)
        logits = self._forward(ids, self.cache, rows, attention_mask=mask,
                               position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        return next_tokens(logits, rows)

    def join(self, row: Row, cache) -> None:
        if not self.rows:
            self.cache, row.pad = cache, 0
        else:
            added, row.pad = batch_cache.merge(self.cache, cache)
            for other in self.rows:
                other.pad += added
        self.rows.append(row)

    def step(self) -> list[int]:
        """One decode forward of every row (each fed its last token); the next token of each."""
        rows = self.rows
        ids = torch.tensor([[r.last] for r in rows], dtype=torch.long, device=self.device)
        mask = padding_mask([r.pad for r in rows], batch_cache.kv_length(self.cache) + 1, self.device)
        positions = torch.tensor([[r.length] for r in rows], dtype=torch.long, device=self.device)
        logits = self._forward(ids, self.cache, rows, attention_mask=mask, position_ids=positions)
        for r in rows:
            r.length += 1
        self.steps += 1
        return next_tokens(logits, rows)

    def keep(self, keep: list[int]) -> None:
        """Only rows `keep` (indices) stay; padding no remaining row needs is cut."""
        if not keep:
            self.rows, self.cache = [], None
            return
        cut = min(self.rows[i].pad for i in keep)
        batch_cache.select(self.cache, keep, cut)
        self.rows = [self.rows[i] for i in keep]
        for r in self.rows:
            r.pad -= cut


def padding_mask(pads: list[int], width: int, device) -> torch.Tensor:
    """[rows, width] attention mask of left-padded rows: 0 on each row's first `pad` positions, 1 after."""
    columns = torch.arange(width, device=device)
    return (columns >= torch.tensor(pads, device=device).unsqueeze(1)).long()


def new_row(prompt_ids: list[int], params: SamplingParams, eos_token_id, device, slot: int = 0) -> Row:
    eos = eos_token_id if isinstance(eos_token_id, (list, tuple, set, frozenset)) else (eos_token_id,)
    stops = frozenset(t for t in (*eos, *params.stop_token_ids) if t is not None)
    return Row(list(prompt_ids), params, stops, slot, row_generator(params, device))


def generate_batch(model, prompts: list[list[int]], params: SamplingParams, *, eos_token_id,
                   lockstep: bool = False, ends: Callable[[list[int]], bool] | None = None,
                   seeds: list[int] | None = None) -> list[list[int]]:
    """The generated tokens of each prompt (no stop token), on an already built model (a training worker's PEFT
    model, its active adapter). All prompts are prefilled in one forward; rows leave the batch as they finish.
    `lockstep=True` keeps every row in and runs exactly one prefill plus max_new_tokens - 1 decode steps, so that
    ranks whose every forward runs collectives (expert parallelism, ZeRO-3) stay in step. `ends(tokens)`: a row
    also finishes once it is true of its tokens (a session's stop strings on the decoded text; the tokens that
    made it true are kept, for the caller to cut). Row i draws with `seeds[i]`, by default params.seed + i."""
    device = next(model.parameters()).device
    if seeds is None and params.seed is not None:
        seeds = [params.seed + i for i in range(len(prompts))]
    rows = [new_row(p, dataclasses.replace(params, seed=seeds[i]) if seeds else params, eos_token_id, device)
            for i, p in enumerate(prompts)]
    batch = DecodeBatch(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for row, token in zip(rows, batch.prefill_all(rows) if rows else [], strict=True):
                _take(row, token, ends)
            for _ in range(params.max_new_tokens - 1):
                if not lockstep:
                    batch.keep([i for i, r in enumerate(batch.rows) if r.finish_reason is None])
                    if not batch.rows:
                        break
                for row, token in zip(batch.rows, batch.step(), strict=True):
                    if row.finish_reason is None:
                        _take(row, token, ends)
    finally:
        model.train(was_training)
    return [r.tokens for r in rows]


def _take(row: Row, token: int, ends: Callable[[list[int]], bool] | None) -> None:
    if not row.take(token) and ends is not None and ends(row.tokens):
        row.finish_reason = "stop"
