"""LoRA on the attention / dense-MLP / shared-expert linears via PEFT; the router stays frozen.
Routed experts get per-expert LoRA in the expert-parallel module (`lora.train_experts`, see workers.experts)."""

from __future__ import annotations

from contextlib import contextmanager

from moetune.api.errors import ErrorCode
from moetune.api.families import check_target_names
from moetune.api.models.base import SpecError
from moetune.api.models.lora import LoraSpec
from moetune.workers.errors import JobError
from moetune.workers.families import auto_model_class, family_for, hf_config, known_family
from moetune.workers.lora.coverage import Coverage, coverage, in_vision_lora, modules, peft_targets


def _linear_names(model) -> list[str]:
    """Names of the linears LoRA may adapt: all of them, or the text model's for a multimodal family."""
    import torch

    fam = known_family(model.config)
    scope = fam.lora_scope if fam else None
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and (scope is None or scope in f".{name}")]


def _scoped_targets(model, lora: LoraSpec):
    """PEFT targets (a layer-type preset resolved, see workers.lora.coverage) restricted to the family's LoRA
    scope, as full module names ("all-linear" minus lm_head)."""
    fam = known_family(model.config)
    targets = lora.target_modules if fam is None else peft_targets(modules(model, fam), lora, fam)
    vision = _vision_targets(model, fam, lora.vision)
    if fam is None or fam.lora_scope is None:
        return targets
    linear = [n for n in _linear_names(model) if not n.endswith("lm_head")]
    if targets != "all-linear":
        linear = [n for n in linear if any(n == t or n.endswith("." + t) for t in targets)]
    return linear + vision


def _vision_targets(model, fam, vision: str) -> list[str]:
    """lora.vision: the vision tower's linears that get LoRA; none by default (the tower stays frozen)."""
    import torch

    if vision == "none":
        return []
    if fam is None or fam.vision_scopes is None:
        raise JobError(ErrorCode.invalid_target_modules, f"lora.vision: {vision!r} needs a model whose vision tower "
                       f"moetune trains; {model.config.model_type} models take text only", "lora.vision")
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and in_vision_lora(n, vision, fam)]


def _check_targets(config: dict, targets: list[str]) -> None:
    """Every requested name must match a linear module (api.families.check_target_names, the control plane's rule)."""
    try:
        check_target_names(config, targets)
    except SpecError as e:
        raise JobError(ErrorCode.invalid_target_modules, e.message, e.param) from None


def check_targets_on_config(config: dict, spec: LoraSpec) -> Coverage:
    """The target check without weights, and what the targets adapt: the model is built on the meta device (no
    memory, no I/O)."""
    import torch

    with torch.device("meta"):
        model = auto_model_class(config).from_config(hf_config(config))
    if isinstance(spec.target_modules, list):
        _check_targets(config, spec.target_modules)
    fam = family_for(model.config)
    found = coverage(modules(model, fam, spec.vision), spec, fam)
    if not found.targets:  # PEFT wraps at least one linear; the routed experts' LoRA lives outside it
        raise JobError(ErrorCode.invalid_target_modules,
                       f"lora.target_modules: the {spec.target_modules!r} preset matches no linear of a "
                       f"{model.config.model_type} model; name some with lora.train_experts: true instead "
                       "(e.g. ['o_proj'])", "lora.target_modules")
    return found


@contextmanager
def _no_v4_target_conversion(model):
    """PEFT 0.21 rewrites the targets `gate`, `gate_proj`, `up_proj`, `down_proj` of the MoE model types its table
    lists into LoRA on the fused routed experts and the router (its transformers v4 -> v5 conversion). Here those
    names mean the dense / shared-expert linears, the router stays frozen and routed experts get their own
    expert-parallel LoRA (`train_experts`), so the conversion is off while wrapping."""
    from peft.utils import transformers_weight_conversion as conversion

    model_type = getattr(model.config, "model_type", None)
    pattern = conversion._MODEL_TO_CONVERSION_PATTERN.pop(model_type, None)
    try:
        yield
    finally:
        if pattern is not None:
            conversion._MODEL_TO_CONVERSION_PATTERN[model_type] = pattern


def apply_lora(model, spec: LoraSpec):
    """Wraps `model` in a PeftModel; only the LoRA weights are trainable afterwards."""
    from peft import LoraConfig, TaskType, get_peft_model

    if isinstance(spec.target_modules, list):
        _check_targets(model.config.to_dict(), spec.target_modules)
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        # "all-linear" leaves out lm_head; the router is no nn.Linear
        target_modules=_scoped_targets(model, spec),
        bias="none",
    )
    with _no_v4_target_conversion(model):
        return get_peft_model(model, config)
