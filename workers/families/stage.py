"""One pipeline stage of a family's model (workers.pipeline): the model's own modules for decoder layers
`bounds[stage]:bounds[stage + 1]` (their parameters are the model's, so a stage's LoRA gradients are the model's, on
that stage's rank), and its forward: the first stage takes token ids, a later one what the stage before it
returned; the last returns the logits, the others a tuple of tensors for the next.

Rows are right-padded and unmasked, as workers.methods.sft collates them (so every layer runs plain causal), and
carry no cache: a training forward. `DecoderStage` is a transformers decoder's; a family whose layers carry more
than hidden states names its own (`Family.pipeline_stage`)."""

from __future__ import annotations

import torch
from torch import nn


class StageModules(nn.Module):
    """The stage's layers, and the embeddings on the first stage, the final norm and output layer on the last."""

    def __init__(self, model: nn.Module, text: nn.Module, bounds: tuple[int, ...], stage: int,
                 emit_logits: bool = True):
        """`emit_logits` False: the last stage returns the final norm's output, whose loss the training method's
        loss head takes (workers.methods.loss_head: no [tokens, vocab] logits)."""
        super().__init__()
        self.embed_tokens = text.embed_tokens if stage == 0 else None
        self.layers = nn.ModuleList(text.layers[bounds[stage]:bounds[stage + 1]])
        last = stage == len(bounds) - 2
        self.norm = text.norm if last else None
        self.lm_head = model.get_output_embeddings() if last else None
        self.emit_logits = emit_logits

    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's output: the logits, or the final norm's output (`emit_logits` False)."""
        hidden = self.norm(hidden)
        return self.lm_head(hidden) if self.emit_logits else hidden


class DecoderStage(StageModules):
    """A transformers decoder's stage: hidden states across the boundary; each stage makes the rotary position
    embeddings of its rows itself."""

    def __init__(self, model, text, bounds, stage, **options):
        super().__init__(model, text, bounds, stage, **options)
        self.rotary_emb = getattr(text, "rotary_emb", None)

    def forward(self, received: torch.Tensor) -> torch.Tensor:
        hidden = received if self.embed_tokens is None else self.embed_tokens(received)
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        kwargs = {"position_ids": positions}
        if self.rotary_emb is not None:
            kwargs["position_embeddings"] = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, **kwargs)
        return hidden if self.lm_head is None else self.output(hidden)
