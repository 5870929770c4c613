"""The registry of model families: each folder's `FAMILY` (family.py), keyed by its model_type, for every family
whose facts api.families found, so a family cannot be half-registered."""

from __future__ import annotations

import importlib

from moetune.api.errors import ErrorCode
from moetune.api.families import FAMILIES, as_transformers_reads_it, unsupported_model_type
from moetune.workers.errors import JobError
from moetune.workers.families.spec import Family

REGISTRY: dict[str, Family] = {t: importlib.import_module(f"{__package__}.{t}.family").FAMILY for t in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in REGISTRY.values()
                  for t in (f.model_type, *f.model_type_aliases, *f.facts.release_model_types)}


def _model_type(config) -> str | None:
    return config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)


def known_family(config) -> Family | None:
    """The family of a config (dict or transformers config), or None for a model type without one."""
    return _BY_MODEL_TYPE.get(_model_type(config))


def family_for(config) -> Family:
    """The family of a config; a JobError naming the supported ones when there is none."""
    found = known_family(config)
    if found is None:
        raise JobError(ErrorCode.unsupported_model, unsupported_model_type(_model_type(config)), "model")
    return found


def demo_family(kind: str) -> Family:
    """The family of the tiny checkpoint of this kind: "text" (the tests'), "seed" (`moetune demo`'s, the seed model
    as released), "images" (`moetune demo --images`')."""
    return next(f for f in REGISTRY.values() if f.demo == kind)


def hf_config(config: dict):
    """The transformers config of a config.json's dict, decoded as `from_pretrained` decodes the file (floats it
    cannot write as JSON, like a Mamba config's `time_step_limit` infinity, are `{"__float__": "Infinity"}` there)."""
    from transformers import AutoConfig, PreTrainedConfig

    return AutoConfig.for_model(**PreTrainedConfig._decode_special_floats(as_transformers_reads_it(config)))


def auto_model_class(config):
    import transformers

    fam = known_family(config)
    return getattr(transformers, fam.auto_class if fam else "AutoModelForCausalLM")


def apply_kernel_swaps(model) -> dict[str, int]:
    """Every kernel swap of the model's family ({} for a model without one); {swap name: modules changed}."""
    fam = known_family(model.config)
    return fam.apply_kernel_swaps(model) if fam else {}
