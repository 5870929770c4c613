"""The running batch's cache, built from transformers' own cache of the family (DynamicCache from the model's
config: a KV layer for full / sparse attention, a fixed-size conv + recurrent state layer for KDA / linear
attention) and reshaped between steps for continuous batching.

Rows join after their prefill alone: their KV is left-padded to the batch's length (the padding is masked out by
the attention mask, each row keeps its own position ids), their recurrent states are stacked. Rows leave by index;
padding that no remaining row needs is cut off.
"""

from __future__ import annotations

import torch

# (attribute, sequence dim) of the per-token tensors of a KV layer: keys / values [B, H, S, D], DSA indexer keys
_KV_TENSORS = (("keys", -2), ("values", -2), ("indexer_keys", 1))


def new_cache(model):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    refused = sorted({type(layer).__name__ for layer in cache.layers
                      if getattr(layer, "is_sliding", False) or "Static" in type(layer).__name__})
    if refused:
        raise NotImplementedError(f"the generation engine does not batch {', '.join(refused)} cache layers yet "
                                  "(sliding-window attention)")
    return cache


def _kv(layer) -> list[tuple[str, int]]:
    """The per-token tensors the layer holds (a zero-width one too: an MLA may cache values of width 0; an
    unfilled layer holds 1-D empty ones)."""
    return [(name, dim) for name, dim in _KV_TENSORS if isinstance(getattr(layer, name, None), torch.Tensor)
            and getattr(layer, name).dim() > 1]


def _states(layer) -> list[tuple[dict, int]]:
    """The (state dict, index) pairs of a linear-attention layer's conv and recurrent states that exist."""
    return [(states, i) for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
            for i, t in states.items() if t is not None]


def kv_length(cache) -> int:
    return max((getattr(layer, "keys").shape[-2] for layer in cache.layers if _kv(layer)), default=0)


def _stacked(mine: torch.Tensor, theirs: torch.Tensor, dim: int, total: int) -> torch.Tensor:
    """`mine`'s rows then `theirs`, each left-padded with zeros to `total` positions along `dim`: one copy of each
    (padding then concatenating would copy the batch's KV twice)."""
    shape = list(mine.shape)
    shape[0], shape[dim] = mine.shape[0] + theirs.shape[0], total
    out = mine.new_zeros(shape)
    for rows, part in ((out[:mine.shape[0]], mine), (out[mine.shape[0]:], theirs)):
        rows.narrow(dim, total - part.shape[dim], part.shape[dim]).copy_(part)
    return out


def merge(batch, row) -> tuple[int, int]:
    """Appends `row`'s cache (one row) to `batch`'s rows, in place; returns the left padding added to the batch's
    rows and to the new row."""
    length, row_length = kv_length(batch), kv_length(row)
    total = max(length, row_length)
    for mine, theirs in zip(batch.layers, row.layers, strict=True):
        for name, dim in _kv(theirs):
            setattr(mine, name, _stacked(getattr(mine, name), getattr(theirs, name), dim, total))
        for (states, i), (their_states, _) in zip(_states(mine), _states(theirs), strict=True):
            states[i] = torch.cat([states[i], their_states[i]], dim=0)
    return total - length, total - row_length


def select(cache, keep: list[int], cut: int) -> None:
    """Keeps the rows `keep` (in that order), in place, and drops the first `cut` positions of every KV layer."""
    index = None
    for layer in cache.layers:
        for name, dim in _kv(layer):
            tensor = getattr(layer, name)
            index = torch.tensor(keep, device=tensor.device) if index is None else index
            tensor = tensor.index_select(0, index)
            setattr(layer, name, tensor.narrow(dim, cut, tensor.shape[dim] - cut))
        for states, i in _states(layer):
            index = torch.tensor(keep, device=states[i].device) if index is None else index
            states[i] = states[i].index_select(0, index)


def cache_bytes(cache, layer_types: list[str] | None) -> dict[str, int]:
    """Bytes held, by layer type (the config's `layer_types`, else "attention")."""
    out: dict[str, int] = {}
    for i, layer in enumerate(cache.layers):
        kind = layer_types[i] if layer_types else "attention"
        held = sum(getattr(layer, name).nbytes for name, _ in _kv(layer))
        held += sum(states[j].nbytes for states, j in _states(layer))
        out[kind] = out.get(kind, 0) + held
    return out
