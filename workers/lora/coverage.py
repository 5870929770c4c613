"""Which modules of each layer type a LoRA spec adapts, and the presets that name layer types.

Every linear LoRA may adapt (the family's scope: a multimodal model's text path) has one layer type: the attention
of its decoder layer (by the config's `layer_types`: linear (also Mamba), full, sliding-window or sparse
attention), a dense MLP, or, inside a MoE block, its shared experts, its latent projections (latent MoE) or its
router (frozen: never adapted). Each MoE block's routed experts are one more module, adapted by the
expert-parallel module's own LoRA (`train_experts`). A vision tower's linears are one more layer type, listed only
when `lora.vision` adapts some (its projector, or all). The same table is a job's first LoRA event and `moetune
models inspect --lora`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from moetune.api.models.lora import LoraSpec
from moetune.kernels.quant import held, held_names
from moetune.workers.families.spec import Family, in_proj_name

ROUTER, ROUTED_EXPERTS, SHARED_EXPERTS, DENSE_MLP = "router", "routed experts", "shared experts", "dense MLP"
VISION = "vision"  # the vision tower's linears (lora.vision), each block a layer and its projector one more
LATENT = "latent projections"  # latent MoE: a block's projections to and from its experts' latent width
# config `layer_types` values -> layer type of the layer's non-MoE linears (transformers calls Mamba mixers
# linear attention too; a hybrid's plain MLP layers are "mlp")
_LAYER_KINDS = {"linear_attention": "linear attention", "full_attention": "full attention",
                "sliding_attention": "sliding-window attention", "indexed_attention": "sparse attention",
                "mlp": DENSE_MLP}
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
_ORDER = ("linear attention", "full attention", "sliding-window attention", "sparse attention", "attention", DENSE_MLP,
          SHARED_EXPERTS, LATENT, ROUTED_EXPERTS, ROUTER, VISION)
PRESETS = {"attention": lambda kind: kind.endswith("attention"),
           "mlp": lambda kind: kind in (DENSE_MLP, SHARED_EXPERTS),
           "experts": lambda kind: kind in (SHARED_EXPERTS, ROUTED_EXPERTS, LATENT),
           "all-linear": lambda kind: kind not in (ROUTER, ROUTED_EXPERTS)}


@dataclass(frozen=True)
class Module:
    name: str  # full module name in the model
    kind: str  # its layer type
    layer: int | str | None  # decoder layer index (vision: its block's, or "projector")
    lora_parameters: int  # LoRA parameters it gets at rank 1


@dataclass
class KindCoverage:
    layers: set = field(default_factory=set)  # decoder layers holding this kind
    adapted_layers: set = field(default_factory=set)
    adapted_names: set = field(default_factory=set)  # leaf names adapted
    frozen_names: set = field(default_factory=set)
    trainable: int = 0


@dataclass
class Coverage:
    kinds: dict[str, KindCoverage]
    targets: list[str] | str  # what PEFT is given (peft_targets)

    @property
    def trainable(self) -> int:
        return sum(k.trainable for k in self.kinds.values())

    def unadapted(self) -> list[str]:
        """Layer types that no module of any layer adapts (the router is meant to stay frozen)."""
        return [kind for kind, c in self.kinds.items() if kind != ROUTER and not c.adapted_layers]

    def warnings(self, lora: LoraSpec) -> list[tuple[str, str]]:
        """(layer type, message) for each linear layer type the spec leaves unadapted everywhere, and the routed
        experts when a list names MLP projections (they then match only dense MLPs and shared experts)."""
        names = lora.target_modules if isinstance(lora.target_modules, list) else []
        names_mlp = any(t.rsplit(".", 1)[-1] in _MLP_NAMES for t in names)
        hint = {ROUTED_EXPERTS: f"{', '.join(n for n in names if n.rsplit('.', 1)[-1] in _MLP_NAMES)} match dense "
                                "MLPs and shared experts only; lora.train_experts or the 'experts' preset adapts "
                                "the routed experts"}
        return [(kind, f"LoRA adapts no {kind} module in any layer (lora.target_modules: {lora.target_modules}); "
                       + hint.get(kind, "the presets 'attention', 'mlp', 'experts' and 'all-linear' name layer types"))
                for kind in self.unadapted() if kind != ROUTED_EXPERTS or names_mlp]

    def rows(self) -> list[dict]:
        return [{"layer_type": kind, "layers": len(c.layers), "adapted_layers": len(c.adapted_layers),
                 "adapted": sorted(c.adapted_names), "not_adapted": sorted(c.frozen_names - c.adapted_names),
                 "trainable_parameters": c.trainable} for kind, c in self.kinds.items()]

    def summary(self) -> str:
        parts = [f"{kind} {len(c.adapted_layers)}/{len(c.layers)} layers"
                 + (f" ({', '.join(sorted(c.adapted_names))})" if c.adapted_names else "")
                 for kind, c in self.kinds.items() if kind != ROUTER]
        return f"LoRA coverage: {'; '.join(parts)}; {self.trainable:,} trainable parameters"


def _layer_of(parts: list[str]) -> int | None:
    return int(parts[parts.index("layers") + 1]) if "layers" in parts and parts[-1] != "layers" else None


def _attention_kinds(config) -> list[str] | None:
    text = getattr(config, "text_config", None) or config
    types = getattr(text, "layer_types", None)
    return [_LAYER_KINDS.get(t, t.replace("_", " ")) for t in types] if types else None


def in_vision_lora(name: str, vision: str, family: Family) -> bool:
    """lora.vision's rule for a linear: "all" adapts the vision tower's, "projector" its projector's, "none" none."""
    if vision == "none" or family.vision_scopes is None:
        return False
    tower, projector = family.vision_scopes
    return projector in f".{name}." or (vision == "all" and tower in f".{name}.")


def _vision_modules(model, family: Family) -> list[Module]:
    import torch

    tower, projector = family.vision_scopes
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (tower in f".{name}." or projector in f".{name}."):
            parts = name.split(".")
            if projector in f".{name}.":
                layer = "projector"
            else:
                layer = int(parts[parts.index("blocks") + 1]) if "blocks" in parts else None
            found.append(Module(name, VISION, layer, module.in_features + module.out_features))
    return found


def modules(model, family: Family, vision: str = "none") -> list[Module]:
    """Every linear LoRA may adapt and every MoE block's routed experts, with its layer type; the vision tower's
    linears too where `vision` (lora.vision) adapts some of them."""
    import torch

    blocks = dict(family.moe_blocks(model))
    attention = _attention_kinds(model.config)
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        layer = _layer_of(parts)
        if name in blocks:
            found.append(Module(f"{name}.{family.router}", ROUTER, layer, 0))
            found.append(Module(f"{name}.{family.experts}", ROUTED_EXPERTS, layer,
                                _expert_lora_width(getattr(module, family.experts))))
            continue
        if not isinstance(module, torch.nn.Linear) or name.endswith("lm_head") or layer is None:
            continue
        out_of_scope = family.lora_scope and family.lora_scope not in f".{name}"
        if out_of_scope or name.rsplit(".", 1)[-1] in family.lora_unsupported:
            continue
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        if block is not None:
            if name.startswith(f"{block}.{family.router}"):
                continue  # a linear router: listed once above, frozen
            shared = family.shared_experts and name.startswith(f"{block}.{family.shared_experts}")
            kind = SHARED_EXPERTS if shared or "shared" in name.rsplit(".", 1)[-1] else LATENT
        elif parts[parts.index("layers") + 2] == "mlp":
            kind = DENSE_MLP
        else:
            kind = attention[layer] if attention else "attention"
        found.append(Module(name, kind, layer, module.in_features + module.out_features))
    return found + (_vision_modules(model, family) if vision != "none" and family.vision_scopes else [])


def _expert_lora_width(experts) -> int:
    """Rank-1 LoRA parameters of all of a block's experts: in + out of each projection (gate_up or up, down),
    whatever the layout."""
    held_here = held_names(experts)
    # a parameter the loader put in its ZeRO-3 partition keeps its whole shape as `ds_shape`
    shapes = [held(experts, n).shape if n in held_here else getattr(getattr(experts, n), "ds_shape",
                                                                     getattr(experts, n).shape)
              for n in (in_proj_name(experts), "down_proj")]
    return sum(shape[0] * (shape[1] + shape[2]) for shape in shapes)


def _matches(name: str, targets: list[str]) -> bool:
    """PEFT's rule for a list of names: the full name, or a suffix at a module boundary."""
    return any(name == t or name.endswith("." + t) for t in targets)


def peft_targets(found: list[Module], lora: LoraSpec, family: Family) -> list[str] | str:
    """What PEFT is given: a layer-type preset as the full names of its linears; "all-linear" (PEFT's own rule:
    every linear but the output layer, and no router is an nn.Linear; resolved here where PEFT would pick a linear
    it then refuses) and a list of names as they are."""
    if isinstance(lora.target_modules, list) or lora.target_modules == "all-linear" and not family.lora_unsupported:
        return lora.target_modules
    wanted = PRESETS[lora.target_modules]
    return [m.name for m in found if m.kind not in (ROUTED_EXPERTS, VISION) and wanted(m.kind)]


def coverage(found: list[Module], lora: LoraSpec, family: Family) -> Coverage:
    targets = peft_targets(found, lora, family)
    kinds: dict[str, KindCoverage] = defaultdict(KindCoverage)
    for m in found:
        c = kinds[m.kind]
        c.layers.add(m.layer)
        leaf = m.name.rsplit(".", 1)[-1]
        if m.kind == ROUTED_EXPERTS:
            adapted = lora.train_experts
        elif m.kind == VISION:
            adapted = in_vision_lora(m.name, lora.vision, family)
        elif isinstance(targets, str):  # "all-linear"
            adapted = PRESETS[targets](m.kind)
        else:
            adapted = m.kind != ROUTER and _matches(m.name, targets)
        if adapted:
            c.adapted_layers.add(m.layer)
            c.adapted_names.add(leaf)
            c.trainable += lora.rank * m.lora_parameters
        else:
            c.frozen_names.add(leaf)
    ordered = sorted(kinds, key=lambda k: _ORDER.index(k) if k in _ORDER else _ORDER.index("attention"))
    return Coverage({k: kinds[k] for k in ordered}, targets)
