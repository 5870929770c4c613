"""The family registry: every family has both halves (torch-free facts for the control plane, a worker module with
its FAMILY), and the facts agree with the real transformers model classes."""

import importlib
import pkgutil

import pytest
import torch
from huggingface_hub.errors import StrictDataclassFieldValidationError

from moetune.api.families import FAMILIES
from moetune.workers import families
from moetune.workers.families import REGISTRY, auto_model_class, family_for, hf_config


def test_every_family_module_has_facts_and_every_fact_a_module():
    modules = {}
    for info in pkgutil.iter_modules(families.__path__):
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        if hasattr(module, "FAMILY"):
            modules[info.name] = module.FAMILY
    assert set(modules) == set(FAMILIES) == set(REGISTRY), "a family is registered in one place and not the other"
    for name, fam in modules.items():
        assert fam is REGISTRY[name] and fam.facts is FAMILIES[name] and fam.model_type == name


def test_sub_model_types_find_their_family_and_unknown_ones_name_the_supported():
    assert family_for({"model_type": "glm5_next_text"}) is REGISTRY["glm5_next"]
    supported = "deepseek_v3, deepseek_v32, deepseek_v4, glm5_next"
    with pytest.raises(Exception, match=f"model_type 'llama' is not supported; supported: {supported}"):
        family_for({"model_type": "llama"})


# Config switches that change which linears a family's model has: MLA's query with and without q_lora_rank,
# qwen3_moe with a dense layer (its only MLP projections: it has no shared experts)
VARIANTS = {"q_lora_rank": (None, 16), "mlp_only_layers": ([0],)}


def _variants(fam):
    config = fam.tiny_config()
    yield config
    text = config.get_text_config()
    for key, values in VARIANTS.items():
        for value in values if hasattr(text, key) else ():
            changed = config.to_dict()
            fam.facts.text_config(changed)[key] = value
            try:
                variant = hf_config(changed)
            except StrictDataclassFieldValidationError:  # a value its config class refuses (deepseek_v32: an int)
                continue
            yield variant


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_facts_match_the_transformers_models(name):
    """The control plane's pure-data facts agree with the real model classes (built on the meta device): the
    linears LoRA may name are exactly those a model of the config has, with each config switch that changes them."""
    fam = REGISTRY[name]
    for config in _variants(fam):
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config)
        linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and (fam.lora_scope is None or fam.lora_scope in f".{n}")}
        assert sorted(linear - {"lm_head", *fam.lora_unsupported}) == fam.facts.linears(config.to_dict()), config
    assert not set(fam.lora_unsupported) & set(fam.facts.linear_names)  # refused at submission
    config = fam.tiny_config()
    blocks = list(fam.moe_blocks(model))
    assert blocks and all(getattr(b, fam.experts).num_experts == fam.facts.num_experts(config.to_dict())
                          for _, b in blocks)
