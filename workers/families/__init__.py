"""Family adapters: where a model's MoE blocks, router, routed and shared experts are.

One module per family registers a `Family`; `family_for(config)` finds it by `model_type`. Every supported
family stores its routed experts as one transformers `*Experts` module with fused 3D `gate_up_proj`
(experts, 2·moe_intermediate, hidden) and `down_proj` (experts, hidden, moe_intermediate), called as
`experts(hidden, top_k_index, top_k_weights)`; the expert-parallel swap replaces exactly that module, so the
family's own router (top-k, scoring, bias correction, scaling) runs unchanged.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from moetune.api.families import FAMILIES, FamilyFacts
from moetune.workers.errors import JobError


@dataclass(frozen=True)
class Family:
    facts: FamilyFacts
    moe_block: str  # class name of the family's MoE block (router + routed experts [+ shared experts])
    shared_experts: str | None  # attribute of the block holding the shared experts, if any
    tiny_config: Callable[..., object]  # a tiny random config of this family (tests, benchmarks)
    router: str = "gate"
    experts: str = "experts"
    auto_class: str = "AutoModelForCausalLM"  # the transformers auto class that builds the trainable model
    lora_scope: str | None = None  # only linears whose name contains this get LoRA (text path of a multimodal model)

    def moe_blocks(self, model) -> Iterator[tuple[str, object]]:
        for name, module in model.named_modules():
            if type(module).__name__ == self.moe_block:
                yield name, module


_MODULES = {"kimi_linear": "kimi_linear", "qwen3_moe": "qwen3_moe", "qwen3_next": "qwen3_next",
            "deepseek_v3": "deepseek_v3", "glm5_next": "glm5_next"}


def family(model_type: str) -> Family:
    if model_type not in _MODULES:
        raise JobError("unsupported_model",
                       f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(_MODULES))}", "model")
    return importlib.import_module(f"moetune.workers.families.{_MODULES[model_type]}").FAMILY


def family_for(config) -> Family:
    model_type = config["model_type"] if isinstance(config, dict) else config.model_type
    return family(model_type)


def known_family(config) -> Family | None:
    """The family adapter, or None for a model type without one (plain dense or unsupported models)."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return family(model_type) if model_type in _MODULES else None


def auto_model_class(config):
    import transformers

    fam = known_family(config)
    return getattr(transformers, fam.auto_class if fam else "AutoModelForCausalLM")


assert set(_MODULES) == set(FAMILIES), "every family needs both its facts and its adapter"
