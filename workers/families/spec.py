"""What moetune knows about one model family, beyond its torch-free facts (api.families): where its MoE blocks and
experts are, how its model is built, which kernel swaps apply, what LoRA may adapt. Each family's family.py defines
one `FAMILY`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from moetune.api.families import FamilyFacts
from moetune.kernels.quant import held_names


@dataclass(frozen=True)
class TinyVision:
    """What a family's tiny vision-language checkpoint (workers.tiny) needs beyond its config: its special image
    tokens (config attribute -> token), what its chat template renders for an image part, and its image processor
    from the vision config (patch, merge sizes)."""

    tokens: dict[str, str]
    placeholder: str
    image_processor: Callable[[object], object]


@dataclass(frozen=True)
class Family:
    """Every supported family stores its routed experts as one transformers `*Experts` module with fused 3D
    `gate_up_proj` (experts, 2·moe_intermediate, hidden) and `down_proj` (experts, hidden, moe_intermediate) (or
    their transposes, where the module says `is_transposed`; optionally with `*_bias` tensors), called as
    `experts(hidden, top_k_index, top_k_weights)`; expert parallelism replaces exactly that module, so the
    family's own router (top-k, scoring, bias correction, scaling) runs unchanged."""

    facts: FamilyFacts
    moe_block: str  # class name of the family's MoE block (router + routed experts [+ shared experts])
    shared_experts: str | None  # attribute of the block holding the shared experts, if any
    tiny_config: Callable[..., object]  # a tiny random config of this family (tests, benchmarks)
    router: str = "gate"
    experts: str = "experts"
    auto_class: str = "AutoModelForCausalLM"  # the transformers auto class that builds the trainable model
    lora_scope: str | None = None  # only linears whose name contains this get LoRA (text path of a multimodal model)
    # name parts of the vision tower and of its projector (inside the tower or beside it), for lora.vision
    vision_scopes: tuple[str, str] | None = None
    # Kernel swaps in the order they are applied; each changes the given model's modules and returns how many.
    swaps: tuple[Callable[[object], int], ...] = ()
    model_type_aliases: tuple[str, ...] = ()  # config model_types of the family's sub-models (e.g. its text model)
    # linear leaf names PEFT refuses to adapt in this family (e.g. a Mamba mixer's out_proj): never LoRA targets
    lora_unsupported: tuple[str, ...] = ()
    # gate_up -> activation of the experts module, where it is not act_fn(gate) · up over [gate; up] halves
    expert_activation: Callable[[object], Callable] | None = None
    tiny_vision: TinyVision | None = None  # what its tiny vision-language checkpoint needs (families that take images)
    demo: str | None = None  # the embedded demo's (and the tests') tiny checkpoint of this kind is this family's
    # rewrites a tiny checkpoint saved by transformers into the family's released format (naming, quantization),
    # where the two differ (workers.tiny)
    as_released: Callable[[str], None] | None = None
    # its pipeline stage's module, where its layers carry more than hidden states (workers.families.stage)
    pipeline_stage: type | None = None

    @property
    def model_type(self) -> str:
        return self.facts.model_type

    def moe_blocks(self, model) -> Iterator[tuple[str, object]]:
        for name, module in model.named_modules():
            if type(module).__name__ == self.moe_block:
                yield name, module

    def apply_kernel_swaps(self, model) -> dict[str, int]:
        """{swap name: modules changed}. A swap changes only the module instances it is given: other models in
        the same process keep the stock code path, which is also how "kernels off" is expressed (do not call it)."""
        return {swap.__name__: swap(model) for swap in self.swaps}


def in_proj_name(experts) -> str:
    """The experts module's first projection: `gate_up_proj` (gated: the activation combines its two halves), or
    `up_proj` (plain MLP experts: act(x W_up) W_down). A quantized base holds it as buffers."""
    names = {*dict(experts.named_parameters(recurse=False)), *held_names(experts)}
    return "up_proj" if "up_proj" in names else "gate_up_proj"
