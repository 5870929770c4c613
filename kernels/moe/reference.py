"""Oracle: the experts one after another, y_e = x_e W_e + s (x_e A_e) B_e, in fp32."""

from __future__ import annotations

import torch


def moe_lora_reference(x_sorted, counts, w, lora_a, lora_b, scale: float) -> torch.Tensor:
    """x_sorted [N, Din] rows grouped by expert (counts[e] rows for expert e, in order); w [E, Din, Dout] frozen;
    lora_a [E, Din, r]; lora_b [E, r, Dout]. Returns [N, Dout] in x's dtype."""
    out = []
    start = 0
    for e, n in enumerate(counts.tolist()):
        x_e = x_sorted[start:start + n].float()
        y_e = x_e @ w[e].detach().float()
        if lora_a is not None:
            y_e = y_e + scale * (x_e @ lora_a[e].float()) @ lora_b[e].float()
        out.append(y_e)
        start += n
    return torch.cat(out).to(x_sorted.dtype)
