"""The ZeRO-3 engine's weights whole for one generation call: gathered once, not once per decoded token.

Under ZeRO-3 DeepSpeed's module hooks gather each module's weights before it runs and free them after it, so
decoding N tokens gathers every partitioned weight N times (tens of GB per token for Kimi K3). GatheredParameters
alone does not keep them: the hooks free what it gathered after each module (measured on the tiny model, ZeRO-3 on
gloo: every partitioned parameter freed again in every forward inside it). DeepSpeed's own
`unwrap_model_for_generation` gathers them once and takes the hooks off for the call (and puts them back after).
"""

from __future__ import annotations

import contextlib

from moetune.workers.engine.deepspeed import partitioned


def partitioned_bytes(model) -> int:
    """Bytes that ZeRO-3's partitioned parameters take whole (what `whole_for_generation` gathers on each rank)."""
    return sum(p.ds_numel * p.element_size() for p in model.parameters() if partitioned(p))


def whole_for_generation(engine):
    """A context in which the engine's model runs forwards without ZeRO-3 gathers (its weights gathered once on
    entry, partitioned again on exit); a no-op when nothing is partitioned. Every rank enters it together."""
    if not any(partitioned(p) for p in engine.module.parameters()):
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    return unwrap_model_for_generation(engine)
