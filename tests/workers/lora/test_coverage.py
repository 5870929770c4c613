"""LoRA presets resolved per layer type, on every supported family: what the coverage table says is adapted is
exactly what PEFT wraps (and, for routed experts, what the expert-parallel module gets), the router never."""

import pytest
import torch

from moetune.api.models.lora import LoraSpec
from moetune.workers.errors import JobError
from moetune.workers.families import REGISTRY, auto_model_class
from moetune.workers.lora.coverage import coverage, modules
from moetune.workers.lora.peft_lora import apply_lora, check_targets_on_config

# preset -> the layer types it must adapt wherever the family has them (deepseek_v4: compressed attentions)
ATTENTION = {"linear attention", "full attention", "sliding-window attention", "sparse attention", "attention",
             "compressed sparse attention", "heavily compressed attention"}
EXPECTED = {"attention": ATTENTION, "mlp": {"dense MLP", "shared experts"},
            "all-linear": ATTENTION | {"dense MLP", "shared experts", "latent projections"}}


@pytest.mark.parametrize("family", sorted(REGISTRY))
@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_a_preset_adapts_its_layer_types_and_peft_wraps_exactly_those(family, preset):
    fam = REGISTRY[family]
    config = fam.tiny_config()
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    spec = LoraSpec(rank=2, target_modules=preset)
    found = modules(model, fam)
    table = coverage(found, spec, fam)
    kinds = set(table.kinds)
    assert "router" in kinds and "routed experts" in kinds
    for kind, c in table.kinds.items():  # a kind is adapted in every layer it has, or in none
        assert c.adapted_layers == (c.layers if kind in EXPECTED[preset] else set()), (kind, c)
    if preset == "all-linear":
        assert table.unadapted() == ["routed experts"]
    if not table.targets:  # e.g. "mlp" on a family without dense MLPs or shared experts: refused before workers
        with pytest.raises(JobError, match="preset matches no linear"):
            check_targets_on_config(config.to_dict(), spec)
        return
    wrapped = {name.removeprefix("base_model.model.").removesuffix(".lora_A") for name, _ in
               apply_lora(model, spec).named_modules() if name.endswith(".lora_A")}
    adapted = {m.name for m in found if table.kinds[m.kind].adapted_layers and m.kind != "routed experts"}
    assert wrapped == adapted and wrapped
    assert not [n for n in wrapped if ".experts." in n or n.endswith(f".{fam.router}")]
    lora_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert lora_params == table.trainable


def test_the_experts_preset_trains_routed_and_shared_experts():
    spec = LoraSpec(target_modules="experts")
    assert spec.train_experts
    table = check_targets_on_config(REGISTRY["deepseek_v3"].tiny_config().to_dict(), spec)
    assert [k for k, c in table.kinds.items() if c.adapted_layers] == ["shared experts", "routed experts"]
    with pytest.raises(JobError, match="preset matches no linear of a gpt_oss model"):  # no shared experts
        check_targets_on_config(REGISTRY["gpt_oss"].tiny_config().to_dict(), spec)
