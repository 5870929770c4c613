"""The family registry: every family is one folder holding all of it (torch-free facts for the control plane, its
FAMILY, its tiny config), and the facts agree with the real transformers model classes."""

import ast
import dataclasses
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import StrictDataclassFieldValidationError

from moetune.api.families import FAMILIES, FamilyFacts
from moetune.workers import families
from moetune.workers.families import REGISTRY, auto_model_class, family_for, hf_config, known_family

FOLDERS = sorted(info.name for info in pkgutil.iter_modules(families.__path__) if info.ispkg)


def test_every_family_module_has_facts_and_every_fact_a_module():
    modules = {name: importlib.import_module(f"{families.__name__}.{name}.family").FAMILY for name in FOLDERS}
    assert set(modules) == set(FAMILIES) == set(REGISTRY), "a family is registered in one place and not the other"
    for name, fam in modules.items():
        assert fam is REGISTRY[name] and fam.facts is FAMILIES[name] and fam.model_type == name


@pytest.mark.parametrize("name", FOLDERS)
def test_every_family_folder_is_complete(name):
    """A family's folder holds its facts (every field the control plane needs, in a module that imports nothing of
    moetune's but the shared linear names: no torch), its FAMILY and a tiny config of that family."""
    package = f"{families.__name__}.{name}"
    facts = importlib.import_module(f"{package}.facts").FACTS
    required = {f.name for f in dataclasses.fields(FamilyFacts)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING} - {"model_type"}
    assert required <= set(facts), f"{name}/facts.py lacks {sorted(required - set(facts))}"
    built = FamilyFacts(name, **facts)
    assert built.expert_count_keys and built.linear_names
    source = Path(importlib.import_module(f"{package}.facts").__file__).read_text()
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"moetune.workers.families.linears"}, f"{name}/facts.py imports {sorted(imported)}"
    fam = importlib.import_module(f"{package}.family").FAMILY
    tiny = importlib.import_module(f"{package}.tiny").tiny_config
    assert fam.tiny_config is tiny and known_family(tiny()) is fam
    if built.images:  # it takes image rows: LoRA knows its vision tower, the tests can build its checkpoint
        assert fam.vision_scopes and fam.tiny_vision


def test_each_demo_checkpoint_is_one_familys():
    for kind in ("text", "seed", "images"):
        assert len([f for f in REGISTRY.values() if f.demo == kind]) == 1, kind
    assert {f.demo for f in REGISTRY.values()} == {None, "text", "seed", "images"}
    assert REGISTRY["kimi_k3"].demo == "seed"  # `moetune demo` trains the seed model


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
