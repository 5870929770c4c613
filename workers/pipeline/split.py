"""Which decoder layers each pipeline stage holds."""

from __future__ import annotations


def stage_bounds(num_layers: int, stages: int, block: int = 1) -> tuple[int, ...]:
    """The first layer of each stage, then `num_layers`: whole blocks of `block` layers (Kimi K3: its
    Attention-Residual blocks; the last block may be shorter), as even as they go, earlier stages taking the extra
    blocks."""
    blocks = -(-num_layers // block)
    if not 1 <= stages <= blocks:
        raise ValueError(f"{num_layers} layers in blocks of {block} do not split into {stages} pipeline stages "
                         f"(at most {blocks})")
    per, extra = divmod(blocks, stages)
    bounds = [0]
    for stage in range(stages):
        bounds.append(min(num_layers, bounds[-1] + (per + (stage < extra)) * block))
    return tuple(bounds)
