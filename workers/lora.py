"""LoRA on the attention / dense-MLP / shared-expert linears via PEFT; the router stays frozen."""

from __future__ import annotations

from api.models import LoraSpec
from workers.errors import JobError


def _check_targets(model, targets: list[str]) -> None:
    """Every requested name must match a linear module the way PEFT matches it (exact or suffix)."""
    import torch

    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
    if unknown:
        available = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise JobError(
            "invalid_target_modules",
            f"lora.target_modules: no linear module named {', '.join(map(repr, unknown))}; "
            f"linear modules of this model: {', '.join(available)}",
            "lora.target_modules",
        )


def check_targets_on_config(config: dict, spec: LoraSpec) -> None:
    """The target check without weights: the model is built on the meta device (no memory, no I/O)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(spec.target_modules, list):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        _check_targets(model, spec.target_modules)


def apply_lora(model, spec: LoraSpec):
    """Wraps `model` in a PeftModel; only the LoRA weights are trainable afterwards."""
    from peft import LoraConfig, TaskType, get_peft_model

    if isinstance(spec.target_modules, list):
        _check_targets(model, spec.target_modules)
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,  # "all-linear" leaves out lm_head; the router is no nn.Linear
        bias="none",
    )
    return get_peft_model(model, config)
