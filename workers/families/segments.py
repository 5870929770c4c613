"""Packed sequences for attention: several sequences in one row, kept apart by their boundaries (`cu_seq_lens_q`,
the offsets transformers' flash-attention path takes), with no mask of any size.

A swapped attention module runs on `moetune_segments`: with boundaries, transformers' own SDPA attention per
sequence (each plainly causal); without them, transformers' SDPA unchanged; both at the key width where the value is
narrower (MLA: families/mla.py). Its mask function builds no mask for a row without padding (transformers would
build a [T, T] block-diagonal one from packed position ids), and transformers' SDPA mask for a padded one.

The boundaries come from the host copy the micro-batch's offsets carry (kernels.kda.packed_offsets), so no layer
reads the device (a host sync per layer, which stalls the launch queue). The per-sequence calls keep SDPA's flash
kernel and exactly Σ length² work; one masked SDPA over the packed row would cost T² work and a [T, T] mask per
layer (2 GB in bf16 at 32K tokens, saved for backward, and not in the planner's count); torch 2.13's varlen
attention (`torch.nn.attention.varlen`) would do it in one call, but runs on CUDA only (flash, 16-bit, head dims
<= 256)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from moetune.kernels.kda import offsets_on_host
from moetune.workers.comm.mla_context import attend_over_row
from moetune.workers.families.context import GATHERS_KEYS, context_slice
from moetune.workers.families.mla import sdpa_at_key_width

ATTN_IMPLEMENTATION = "moetune_segments"


def _segments_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention-interface signature: query/key/value [B, H, T, D]; returns ([B, T, H, Dv], None).
    In a CP forward (workers.families.context) the keys are the whole row's and the slice's layout says which of
    them each query sees."""
    if (part := context_slice(module)) is not None:
        if attention_mask is not None or dropout:
            raise ValueError("a context-parallel attention takes no padding mask and no attention dropout")
        return attend_over_row(query, key, value, part.layout, scaling), None
    offsets = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if offsets is None:
        return sdpa_at_key_width(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    bounds = offsets_on_host(offsets).tolist()
    outs = [sdpa_at_key_width(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, dropout,
                              scaling, **kwargs)[0] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(outs, dim=1), None


def _segments_mask(attention_mask=None, **kwargs):
    return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)


def segment_attention_swap(attention_class: str) -> Callable[[torch.nn.Module], int]:
    """The swap for a family whose softmax-attention modules are `attention_class` (they call the attention
    interface of their config)."""

    def apply_segment_attention(model: torch.nn.Module) -> int:
        """Packed-sequence attention for every `attention_class` module; returns how many changed."""
        modules = [m for m in model.modules()
                   if type(m).__name__ == attention_class and not getattr(m, "_moetune_segments", False)]
        if modules:
            AttentionInterface.register(ATTN_IMPLEMENTATION, _segments_attention)
            AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _segments_mask)
        for module in modules:
            module.config._attn_implementation = ATTN_IMPLEMENTATION
            module._moetune_segments = True
            setattr(module, GATHERS_KEYS, True)
        return len(modules)

    return apply_segment_attention


def packs_sequences(model: torch.nn.Module) -> bool:
    """Whether the model's attention was swapped for packed sequences (a family has this swap only where its other
    layers keep packed sequences apart too, e.g. with a KDA swap)."""
    return any(getattr(m, "_moetune_segments", False) for m in model.modules())
