"""Whether a session's `sample` may hold the model's ZeRO-3-partitioned weights whole for the call
(workers.engine.generation: gathered once, instead of once per decoded token).

Holding them whole costs their full size on every GPU at once. Kimi K3's dense weights (57 B parameters, 114 GB in
bf16) are more than an H100's 80 GB and all but 27 GB of an H200's 141 GB, which must also hold the rank's experts,
the LoRA and its optimizer state, and the KV cache; regathering them per token instead (what ZeRO-3 does unaided)
moves ~114 GB per decoded token per rank, minutes per token. So sampling is refused, with the numbers, for a model
whose partitioned weights exceed WHOLE_WEIGHTS_SHARE of a rank's memory, and gathered once for the others.
"""

from __future__ import annotations

WHOLE_WEIGHTS_SHARE = 0.5  # the rest of the rank's memory: its own shards and experts, LoRA state, the KV cache


def whole_weights_refusal(whole_bytes: int, rank_memory_bytes: int) -> str | None:
    """Why `sample` cannot hold `whole_bytes` of gathered weights on a rank with `rank_memory_bytes`; None when it
    can."""
    bound = WHOLE_WEIGHTS_SHARE * rank_memory_bytes
    if whole_bytes <= bound:
        return None
    return (f"sample is not available for this model under ZeRO-3: decoding needs its ZeRO-3-partitioned weights "
            f"whole on every worker ({whole_bytes / 1e9:.1f} GB), over {WHOLE_WEIGHTS_SHARE:.0%} of a worker's "
            f"memory ({bound / 1e9:.1f} GB of {rank_memory_bytes / 1e9:.1f} GB); gathering them per decoded token "
            f"instead would move {whole_bytes / 1e9:.1f} GB per token. forward and forward_backward are not "
            f"affected")
