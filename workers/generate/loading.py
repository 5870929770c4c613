"""The served base, built the way a training worker builds it (workers.weights streams the checkpoint, quantized
weights stay quantized; the family's kernel swaps), at EP=1: the routed experts move into moetune's experts
module (which runs dense and quantized experts alike) wrapped for per-row adapter selection."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

from moetune.api import storage
from moetune.api.models import LoraSpec
from moetune.workers.families import apply_kernel_swaps, family_for
from moetune.workers.generate.adapter_rows import RowLoraExperts, RowSelection
from moetune.workers.model import load_dtype, load_tokenizer
from moetune.workers.parallel import parallelize
from moetune.workers.parallel.placement import placement_at
from moetune.workers.weights.loader import stream_model, streamed_or_unused


@dataclass
class LoadedBase:
    model: object
    tokenizer: object
    context_length: int
    experts: dict[str, RowLoraExperts]  # module path -> per-row experts
    dtype: object  # the compute dtype (of LoRA factors too)
    stop_ids: frozenset[int]  # eos of the tokenizer and of the generation config
    layer_types: list[str] | None
    load_seconds: float
    bytes_from_storage: int


def load_base(base_uri: str, device, selection: RowSelection, slots: int,
              weights_cache_dir: str | None = None) -> LoadedBase:
    with tempfile.TemporaryDirectory(prefix="moetune-serve-") as local:
        storage.download_dir(base_uri, local, skip=streamed_or_unused)  # config + tokenizer; weights are streamed
        tokenizer = load_tokenizer(local)
        with open(os.path.join(local, "config.json")) as f:
            config = json.load(f)
    dtype = load_dtype(device)
    streamed = stream_model(base_uri, device, dtype, None, weights_cache_dir)
    model = streamed.model
    apply_kernel_swaps(model)
    family = family_for(model.config)
    experts = {}
    placement = placement_at(config, 1, 0)
    if placement is not None:
        blocks = list(family.moe_blocks(model))
        transposed = {name: getattr(getattr(b, family.experts), "is_transposed", False) for name, b in blocks}
        parallelize(model, family, placement, LoraSpec(), fused_kernel=True)
        for name, block in blocks:
            wrapper = RowLoraExperts(getattr(block, family.experts), selection, slots, dtype, device,
                                     transposed[name])
            setattr(block, family.experts, wrapper)
            experts[f"{name}.{family.experts}"] = wrapper
    text_config = model.config.get_text_config()
    context = getattr(text_config, "max_position_embeddings", None) or tokenizer.model_max_length
    model.eval()
    model.requires_grad_(False)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop_ids = frozenset(t for t in (tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos]))
                         if t is not None)
    return LoadedBase(model, tokenizer, int(context), experts, dtype, stop_ids,
                      getattr(text_config, "layer_types", None), streamed.seconds, streamed.stats.bytes_from_storage)
