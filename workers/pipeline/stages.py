"""One pipeline stage's forward over a model's decoder layers `bounds[stage]:bounds[stage + 1]` (split.stage_bounds):
the first stage takes token ids, a later one what the stage before it returned; the last returns the logits, the
others a tuple of tensors for the next. The stage holds the model's own modules (their parameters are the model's),
so a stage's LoRA gradients are the model's, on that stage's rank.

Rows are right-padded and unmasked, as workers.methods.sft collates them (so every layer runs plain causal), and
carry no cache: a training forward."""

from __future__ import annotations

import torch
from torch import nn

from moetune.workers.families.kimi_k3.modeling import KimiK3TextModel, attn_res_mix


def text_model(model: nn.Module) -> nn.Module:
    """The module that holds the token embeddings and the decoder layers (under any wrapper: PEFT, a vision
    model's text model)."""
    return next(m for m in model.modules()
                if isinstance(getattr(m, "layers", None), nn.ModuleList) and hasattr(m, "embed_tokens"))


def stage_module(model: nn.Module, bounds: tuple[int, ...], stage: int) -> nn.Module:
    """The module of pipeline stage `stage` of `model`."""
    text = text_model(model)
    kind = KimiK3Stage if isinstance(text, KimiK3TextModel) else DecoderStage
    return kind(model, text, bounds, stage)


class _Stage(nn.Module):
    def __init__(self, model: nn.Module, text: nn.Module, bounds: tuple[int, ...], stage: int):
        super().__init__()
        self.embed_tokens = text.embed_tokens if stage == 0 else None
        self.layers = nn.ModuleList(text.layers[bounds[stage]:bounds[stage + 1]])
        last = stage == len(bounds) - 2
        self.norm = text.norm if last else None
        self.lm_head = model.get_output_embeddings() if last else None


class DecoderStage(_Stage):
    """A transformers decoder's stage: hidden states across the boundary; each stage makes the rotary position
    embeddings of its rows itself."""

    def __init__(self, model, text, bounds, stage):
        super().__init__(model, text, bounds, stage)
        self.rotary_emb = getattr(text, "rotary_emb", None)

    def forward(self, received: torch.Tensor) -> torch.Tensor:
        hidden = received if self.embed_tokens is None else self.embed_tokens(received)
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        kwargs = {"position_ids": positions}
        if self.rotary_emb is not None:
            kwargs["position_embeddings"] = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, **kwargs)
        return hidden if self.lm_head is None else self.lm_head(self.norm(hidden))


class KimiK3Stage(_Stage):
    """Kimi K3's stage: across the boundary the running sum of the current Attention-Residual block and the sum of
    every completed block (the embeddings the first), which every later sub-layer mixes."""

    def __init__(self, model, text, bounds, stage):
        super().__init__(model, text, bounds, stage)
        self.output_attn_res_norm = text.output_attn_res_norm if self.norm is not None else None
        self.output_attn_res_proj = text.output_attn_res_proj if self.norm is not None else None

    def forward(self, *received: torch.Tensor):
        if self.embed_tokens is not None:
            partial, blocks = self.embed_tokens(received[0]), []
        else:
            partial, *blocks = received
        for layer in self.layers:
            partial, blocks = layer(partial, blocks, attention_mask=None)
        if self.lm_head is None:
            return (partial, *blocks)
        hidden = attn_res_mix(blocks, partial, self.output_attn_res_norm, self.output_attn_res_proj)
        return self.lm_head(self.norm(hidden))
