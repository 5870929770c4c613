"""Pure-data facts about the supported MoE model families, keyed by config.json's `model_type`: the class, and the
loader of each family's own (in its folder, workers/families/<model_type>/facts.py).

The control plane uses them to reject a job at submission (expert count, LoRA target names) without
importing torch; the workers' family adapters (workers/families/) use the same facts.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from moetune.api.config_fields import config_error, read
from moetune.api.models.base import SpecError
from moetune.api.models.lora import LoraSpec
from moetune.api.models.parallelism import ParallelDims
from moetune.api.quantization import quantization_of


def _none(text: dict) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class FamilyFacts:
    model_type: str
    expert_count_keys: tuple[str, ...]  # config.json keys holding the routed expert count, first present wins
    linear_names: tuple[str, ...]  # LoRA target names PEFT can match (leaf names of nn.Linear modules) ...
    text_config_key: str | None = None  # multimodal checkpoints: the text model's config lives under this key
    images: bool = False  # moetune feeds image rows through the family's processor (checkpoints with a vision tower)
    image_token_key: str = "image_token_id"  # the config.json key of the token each image token takes
    # ... of which these are absent from a model of the given (text) config
    absent_linears: Callable[[dict], tuple[str, ...]] = _none
    # model_types of released checkpoints of this family's architecture that transformers does not know
    release_model_types: tuple[str, ...] = ()
    context_parallel: bool = False  # every layer that mixes tokens has a CP path (workers.families.context)
    pipeline: bool = False  # its decoder layers split into pipeline stages (workers.families.stage)
    # the text config's key giving the layers of one block that stage boundaries keep whole (Kimi K3's
    # Attention-Residual blocks: a stage then passes on every completed block's sum besides the hidden states)
    stage_block_key: str | None = None

    def text_config(self, config: dict) -> dict:
        """The part of config.json that configures the text model (all of it, unless the family nests it)."""
        return read(config, self.text_config_key, dict) or {} if self.text_config_key else config

    def num_experts(self, config: dict) -> int | None:
        """The routed expert count (the first of its keys present); a SpecError naming a malformed one."""
        where = self.text_config_key or ""
        text = self.text_config(config)
        key = next((k for k in self.expert_count_keys if text.get(k) is not None), None)
        count = read(text, key, int, where) if key else None
        if count is not None and count <= 0:
            raise config_error(f"{where}.{key}".lstrip("."), f"must be a positive number of experts, not {count}")
        return count

    def num_layers(self, config: dict) -> int | None:
        """The decoder layer count (transformers' `num_hidden_layers`); a SpecError naming a malformed one."""
        where = self.text_config_key or ""
        count = read(self.text_config(config), "num_hidden_layers", int, where)
        if count is not None and count <= 0:
            raise config_error(f"{where}.num_hidden_layers".lstrip("."), f"must be a positive number of layers, "
                                                                        f"not {count}")
        return count

    def stage_block(self, config: dict) -> int:
        """Layers a pipeline stage keeps whole (1: any layer may end a stage)."""
        if self.stage_block_key is None:
            return 1
        where = self.text_config_key or ""
        block = read(self.text_config(config), self.stage_block_key, int, where)
        if block is None or block <= 0:
            raise config_error(f"{where}.{self.stage_block_key}".lstrip("."), f"must be a positive number of layers, "
                                                                             f"not {block}")
        return block

    def linears(self, config: dict) -> list[str]:
        """The leaf names of the linears LoRA may adapt in a model of this config.json."""
        absent = self.absent_linears(self.text_config(config))
        return sorted(set(self.linear_names) - set(absent))

    def unknown_targets(self, config: dict, targets: list[str]) -> list[str]:
        """Names that match no linear module of a model of this config.json (PEFT matches a name exactly or as a
        suffix)."""
        names = self.linears(config)
        return [t for t in targets if t.rsplit(".", 1)[-1] not in names]


# Each family's folder, workers/families/<model_type>/, holds its facts: facts.py's FACTS, the fields above but
# model_type. Those modules are torch-free and import nothing of moetune's but workers/families/linears.py, so the
# control plane reads them by name without the training stack.
_FAMILY_FOLDERS = "moetune.workers.families"


def _load_facts() -> dict[str, FamilyFacts]:
    folders = importlib.import_module(_FAMILY_FOLDERS).__path__
    names = sorted(m.name for m in pkgutil.iter_modules(folders) if m.ispkg)
    return {name: FamilyFacts(name, **importlib.import_module(f"{_FAMILY_FOLDERS}.{name}.facts").FACTS)
            for name in names}


FAMILIES: dict[str, FamilyFacts] = _load_facts()


def unsupported_model_type(model_type) -> str:
    """The one answer to a model_type no family has (submission, `moetune plan`, `models inspect`, the loader)."""
    return f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"


_BY_RELEASE_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.release_model_types}


def known_facts(config: dict) -> FamilyFacts | None:
    """The family of a config.json (by its model_type, a release's own included), None for none."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    return FAMILIES.get(model_type) or _BY_RELEASE_MODEL_TYPE.get(model_type)


def as_transformers_reads_it(config: dict) -> dict:
    """config.json with a release's model_type replaced by its family's, the one transformers builds."""
    facts = _BY_RELEASE_MODEL_TYPE.get(config.get("model_type"))
    return {**config, "model_type": facts.model_type} if facts else config


def facts_of(config: dict) -> FamilyFacts:
    """The family of a config.json, with every field moetune reads from it checked (a SpecError, param `model`,
    naming a malformed field or listing the supported model types)."""
    facts = known_facts(config)
    if facts is None:
        raise SpecError("model", f"model: {unsupported_model_type(read(config, 'model_type', str))}")
    for key in ("text_config", "vision_config"):
        read(config, key, dict)
    facts.num_experts(config)
    text = read(config, "text_config", dict) or {}
    for where, part in (("", config), ("text_config", text)):
        if (vocab := read(part, "vocab_size", int, where)) is not None and vocab <= 0:
            raise config_error(f"{where}.vocab_size".lstrip("."), f"must be a positive integer, not {vocab}")
    quantization_of(config)  # an unsupported or malformed quantized format
    return facts


def images_refusal(config: dict, parallelism: ParallelDims | None = None) -> str | None:
    """Why a job on this checkpoint (and `parallelism`) cannot train on rows with images, phrased to follow "but";
    None when it can. Context parallelism cuts token rows only: the vision tower's image tokens would have to be
    split with them; a pipeline's first stage takes token ids only."""
    model_type = config.get("model_type")
    facts = known_facts(config)
    if facts is None or not facts.images:
        return f"moetune trains {model_type!r} models on text only (no image input for this family)"
    if "vision_config" not in config:
        return "the model has no vision tower (its config.json has no vision_config)"
    cp, pp = (parallelism.context_parallel_size, parallelism.pipeline_parallel_size) if parallelism else (1, 1)
    if cp > 1:
        return (f"a job with parallelism.context_parallel_size = {cp} trains on text only (context parallelism "
                "splits token rows, not images); use context_parallel_size 1 for image rows")
    if pp > 1:
        return (f"a job with parallelism.pipeline_parallel_size = {pp} trains on text only (its first stage takes "
                "token ids, not images); use pipeline_parallel_size 1 for image rows")
    return None


def check_model_spec(config: dict, lora: LoraSpec, parallelism: ParallelDims) -> None:
    """Rules that need the model's config.json, on the job's `lora` and `parallelism` sections; raises
    api.models.base.SpecError naming the field. Used at submission (422) and again by the driver before workers
    start."""
    facts = facts_of(config)  # a malformed field or an unsupported model before the family's own rules
    pipelined = parallelism.pipeline_parallel_size > 1
    parallelism.check_model(facts.num_experts(config), facts.num_layers(config),
                            facts.stage_block(config) if pipelined else 1)
    if pipelined and not facts.pipeline:
        able = sorted(name for name, f in FAMILIES.items() if f.pipeline)
        raise SpecError("parallelism.pipeline_parallel_size",
                        f"a {facts.model_type} model has no pipeline-stage split yet; the families that have one: "
                        f"{', '.join(able)}")
    if parallelism.context_parallel_size > 1 and not facts.context_parallel:
        able = sorted(name for name, f in FAMILIES.items() if f.context_parallel)
        raise SpecError("parallelism.context_parallel_size", f"a {facts.model_type} model has no context-parallel "
                                                             f"path yet; the families that have one: {', '.join(able)}")
    if lora.vision != "none" and (why := images_refusal(config, parallelism)):
        raise SpecError("lora.vision", f"{lora.vision!r} puts LoRA on the model's vision tower, but {why}; "
                                       f"use \"none\" (the default)")
    if isinstance(lora.target_modules, list):
        check_target_names(config, lora.target_modules)


def check_target_names(config: dict, targets: list[str]) -> None:
    """The one rule for LoRA target names (submission, the driver, the workers' PEFT wrapping): each must name a
    linear of a model of this config.json; a SpecError (param lora.target_modules) lists the ones it has."""
    facts = facts_of(config)
    if unknown := facts.unknown_targets(config, targets):
        raise SpecError("lora.target_modules",
                        f"lora.target_modules: no linear module named {', '.join(map(repr, unknown))} in this "
                        f"{facts.model_type} model; its linear modules: {', '.join(facts.linears(config))}")
