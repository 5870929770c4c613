"""Expert LoRA in PEFT's layout: `target_parameters` on the fused expert tensors (gate_up_proj, down_proj).

PEFT nests one ParamWrapper per targeted tensor on the `experts` module; with targets listed as
[gate_up_proj, down_proj] the inner wrapper (`experts.base_layer`) adapts gate_up_proj and the outer one
(`experts`) adapts down_proj. For E experts and rank r, PEFT stores lora_A as (E·r, in), expert-major, and
lora_B as (out, r·E), expert-minor; ΔW_e = scaling · B_e A_e, the same low-rank update the engine applies, with
the one scaling rule of `lora_scaling`.
"""

from __future__ import annotations

import math


def lora_scaling(alpha: float, rank: int, rslora: bool = False) -> float:
    """PEFT's LoRA scaling: alpha / r, or alpha / √r for rank-stabilized LoRA (`use_rslora`, adapters trained
    elsewhere; moetune trains without it)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def target_parameters(in_proj: str = "gate_up_proj") -> list[str]:
    """PEFT's `target_parameters` of expert LoRA, the first projection (gate_up_proj, or up_proj) first."""
    return [f"experts.{in_proj}", "experts.down_proj"]

# (our factor names, PEFT key infix under the experts module)
_LAYOUT = (("lora_gate_up_a", "lora_gate_up_b", "base_layer."), ("lora_down_a", "lora_down_b", ""))


def a_to_peft(a):
    """(E, r, in) -> (E·r, in)."""
    return a.reshape(-1, a.shape[-1])


def b_to_peft(b):
    """(E, out, r) -> (out, r·E)."""
    return b.permute(1, 2, 0).reshape(b.shape[1], -1)


def a_from_peft(weight, num_experts: int):
    return weight.reshape(num_experts, -1, weight.shape[-1])


def b_from_peft(weight, num_experts: int):
    return weight.reshape(weight.shape[0], -1, num_experts).permute(2, 0, 1)


def expert_keys(experts_key: str):
    """(A factor, B factor, PEFT key of A, PEFT key of B) of one MoE block's experts module, per adapted tensor."""
    for a_name, b_name, infix in _LAYOUT:
        yield a_name, b_name, f"{experts_key}.{infix}lora_A.weight", f"{experts_key}.{infix}lora_B.weight"


def peft_expert_state(experts_key: str, factors: dict) -> dict:
    """PEFT adapter entries for one MoE block from its full (all-expert) factors keyed by our names."""
    state = {}
    for a_name, b_name, key_a, key_b in expert_keys(experts_key):
        state[key_a] = a_to_peft(factors[a_name]).contiguous()
        state[key_b] = b_to_peft(factors[b_name]).contiguous()
    return state


def factors_from_peft(experts_key: str, state: dict, num_experts: int) -> dict:
    """Inverse of peft_expert_state: our (E, ...) factors from PEFT adapter entries."""
    factors = {}
    for a_name, b_name, infix in _LAYOUT:
        factors[a_name] = a_from_peft(state[f"{experts_key}.{infix}lora_A.weight"], num_experts)
        factors[b_name] = b_from_peft(state[f"{experts_key}.{infix}lora_B.weight"], num_experts)
    return factors


def _v4_converted_names(model_type: str | None) -> set[str]:
    """Target names that PEFT 0.21 rewrites at load time for this model type (its transformers v4 -> v5 MoE
    conversion turns e.g. `gate_proj` into LoRA on the fused routed experts)."""
    from peft.utils import transformers_weight_conversion as conversion

    pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
    return set(conversion._MOE_TARGET_MODULE_MAPPING.get(pattern, {}))


def loadable_adapter_config(config, model_type: str | None, expert_in_proj: str | None):
    """A copy of the trained LoRA config that `PeftModel.from_pretrained` loads onto the plain model as trained.

    Linears whose names PEFT would rewrite (shared experts and dense MLPs of the model types its table lists) are
    listed as `target_parameters` on their weight instead: PEFT converts only `target_modules`, and parameter LoRA
    on a 2D weight has the same keys and the same update. Parameter LoRA rejects dropout, which only acts in training,
    so the exported config has none once it uses `target_parameters`.
    """
    import copy

    config = copy.deepcopy(config)
    converted = _v4_converted_names(model_type)
    targets = set(config.target_modules or ())  # PEFT resolved "all-linear" into names when it wrapped the model
    moved = sorted(t for t in targets if t.rsplit(".", 1)[-1] in converted)
    parameters = [f"{t}.weight" for t in moved] + (target_parameters(expert_in_proj) if expert_in_proj else [])
    if parameters:
        config.target_modules = sorted(targets - set(moved)) or None
        config.target_parameters = parameters
        config.lora_dropout = 0.0
    return config
