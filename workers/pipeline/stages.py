"""One pipeline stage's module over a model's decoder layers `bounds[stage]:bounds[stage + 1]` (split.stage_bounds):
the family's stage (workers.families.stage), built from the model's own modules."""

from __future__ import annotations

from torch import nn

from moetune.workers.families import family_for
from moetune.workers.families.stage import DecoderStage
from moetune.workers.pipeline.split import stage_bounds


def text_model(model: nn.Module) -> nn.Module:
    """The module that holds the token embeddings and the decoder layers (under any wrapper: PEFT, a vision
    model's text model; `embed_tokens` or, as Nemotron-H names them, `embeddings`)."""
    embeddings = model.get_input_embeddings()
    return next(m for m in model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleList)
                and any(child is embeddings for child in m.children()))


def model_stage_bounds(model: nn.Module, stages: int) -> tuple[int, ...]:
    """split.stage_bounds of `model`'s decoder layers in `stages` stages of its family's whole blocks."""
    family = family_for(model.config)
    return stage_bounds(model.config.get_text_config().num_hidden_layers, stages,
                        family.facts.stage_block(model.config.to_dict()))


def stage_module(model: nn.Module, bounds: tuple[int, ...], stage: int, emit_logits: bool = True) -> nn.Module:
    """The module of pipeline stage `stage` of `model` (`emit_logits`: see workers.families.stage)."""
    kind = family_for(model.config).pipeline_stage or DecoderStage
    return kind(model, text_model(model), bounds, stage, emit_logits=emit_logits)


def stage_tensor_names(model: nn.Module, bounds: tuple[int, ...], stage: int) -> set[str]:
    """The names (the model's) of the parameters and persistent buffers stage `stage` runs on: all its rank loads
    (workers.weights.loader.stream_model's `held`)."""
    module = stage_module(model, bounds, stage)
    used = {id(t) for t in (*module.parameters(), *module.buffers())}
    persistent = model.state_dict(keep_vars=True)
    return {name for name, p in model.named_parameters() if id(p) in used} | \
        {name for name, b in model.named_buffers() if id(b) in used and name in persistent}
