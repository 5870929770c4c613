"""The served base, built by workers.model's builder in its `serve` mode (the checkpoint streamed, quantized weights
kept quantized, the family's kernel swaps, the routed experts in moetune's experts module at EP=1, which runs dense
and quantized experts alike), its experts then wrapped for per-row adapter selection. A base whose weights cannot fit
the device is refused before any of them is read (workers.planner.serving)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

from moetune.api import storage
from moetune.workers.experts.serving_slots import RowLoraExperts
from moetune.workers.model import SERVE, WeightsSource, build_model, load_dtype, load_tokenizer
from moetune.workers.planner.serving import refuse_unless_it_fits
from moetune.workers.reporting.step_figures import memory_budget_bytes
from moetune.workers.weights.loader import streamed_or_unused


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
        with open(os.path.join(local, "config.json")) as f:
            config = json.load(f)
        refuse_unless_it_fits(config, load_dtype(device), memory_budget_bytes(device, None), base_uri, str(device))
        tokenizer = load_tokenizer(local)
    built = build_model(SERVE, config, device=device, weights=WeightsSource(base_uri, weights_cache_dir),
                        read_base=_transposed_experts)
    model, family, dtype = built.model, built.family, load_dtype(device)
    experts = {}
    for name, block in list(family.moe_blocks(model)):
        wrapper = RowLoraExperts(getattr(block, family.experts), selection, slots, dtype, device, built.base[name])
        setattr(block, family.experts, wrapper)
        experts[f"{name}.{family.experts}"] = wrapper
    text_config = model.config.get_text_config()
    context = getattr(text_config, "max_position_embeddings", None) or tokenizer.model_max_length
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop_ids = frozenset(t for t in (tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos]))
                         if t is not None)
    return LoadedBase(model, tokenizer, int(context), experts, dtype, stop_ids,
                      getattr(text_config, "layer_types", None), built.streamed.seconds,
                      built.streamed.stats.bytes_from_storage)


def _transposed_experts(model, family) -> dict[str, bool]:
    """MoE block -> whether the checkpoint stores its experts [E, in, out] (the adapters' layout follows it)."""
    return {name: getattr(getattr(block, family.experts), "is_transposed", False)
            for name, block in family.moe_blocks(model)}
