"""The name mapper's renaming, remembered per shape of key (numeric name components aside), answers what
transformers' own renaming rules answer for every key, and is not used for a family whose rules name a number."""

import random

import torch

from moetune.workers.families import REGISTRY
from moetune.workers.weights.loader import empty_model
from moetune.workers.weights.mapping import NameMapper


def _mapper(family: str) -> NameMapper:
    config = REGISTRY[family].tiny_config()
    return NameMapper(empty_model(config.to_dict(), torch.float32))


def test_renaming_by_shape_is_transformers_renaming():
    mapper = _mapper("kimi_k3")  # the release's per-expert tensors, merged by a converter; a prefix renaming
    renamer = mapper.renamer
    assert renamer.shapes == {}
    rng = random.Random(0)
    keys = [f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
            for layer in (0, 1, 3, 12) for expert in (0, 3, 7, 12, 895) for w in ("w1", "w2", "w3")]
    keys += [f"language_model.model.layers.{rng.randrange(100)}.self_attn.q_proj.weight" for _ in range(20)]
    keys += ["language_model.model.embed_tokens.weight", "language_model.model.layers.007.mlp.gate.weight"]
    for key in rng.sample(keys, len(keys)):
        assert renamer(key) == renamer._rename(key), key
    assert renamer.shapes and all(renamer.shapes.values())  # each shape renamed with stand-ins, then reused
    merged = mapper.target("language_model.model.layers.3.block_sparse_moe.experts.12.w3.weight")
    assert (merged.param, merged.expert, merged.part) == (
        "language_model.model.layers.3.block_sparse_moe.experts.gate_up_proj", 12, 1)


def test_rules_that_name_a_number_rename_every_key():
    renamer = _mapper("kimi_k25").renamer  # its projector's `mm_projector.proj.0` / `.2` rules
    assert renamer.shapes is None
    for key in ("mm_projector.proj.0.weight", "mm_projector.proj.2.weight", "mm_projector.proj.1.weight"):
        assert renamer(key) == renamer._rename(key)
    assert renamer("mm_projector.proj.0.weight")[1] != renamer("mm_projector.proj.2.weight")[1].replace(".2.", ".0.")
