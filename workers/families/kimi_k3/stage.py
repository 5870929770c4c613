"""Kimi K3's pipeline stage (workers.families.stage): across each boundary the running sum of the current
Attention-Residual block and the sum of every completed block (the embeddings the first), which every later
sub-layer mixes."""

from __future__ import annotations

import torch

from moetune.workers.families.kimi_k3.modeling import attn_res_mix
from moetune.workers.families.stage import StageModules


class KimiK3Stage(StageModules):
    def __init__(self, model, text, bounds, stage, **options):
        super().__init__(model, text, bounds, stage, **options)
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
        return self.output(hidden)
