"""Pure-data facts about the supported MoE model families, keyed by config.json's `model_type`.

The control plane uses them to reject a job at submission (expert count, LoRA target names) without
importing torch; the workers' family adapters (workers/families/) use the same facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moetune.api.config_fields import config_error, read
from moetune.api.models import SpecError
from moetune.api.quantization import quantization_of

# Linear module names every family shares (dense MLPs and shared experts).
_MLP = ("gate_proj", "up_proj", "down_proj")
# Multi-head latent attention (DeepSeek-V3 style), used by kimi_linear's full-attention layers too.
_MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _none(text: dict) -> tuple[str, ...]:
    return ()


def _mla_query(text: dict) -> tuple[str, ...]:
    """MLA's query is one q_proj, or q_a_proj -> q_b_proj with a q_lora_rank: the other names are absent."""
    return ("q_proj",) if text.get("q_lora_rank") else ("q_a_proj", "q_b_proj")


def _mla_query_beside_kda(text: dict) -> tuple[str, ...]:
    """The same, where KDA layers have a q_proj of their own."""
    return () if text.get("q_lora_rank") else ("q_a_proj", "q_b_proj")


def _qwen3_moe_mlp(text: dict) -> tuple[str, ...]:
    """qwen3_moe has no shared experts: its MLP projections exist only in dense layers (`mlp_only_layers`, or
    those `decoder_sparse_step` skips), as transformers' Qwen3MoeDecoderLayer builds them."""
    dense = text.get("mlp_only_layers") or (text.get("decoder_sparse_step") or 1) > 1 or text.get("num_experts") == 0
    return () if dense else _MLP


@dataclass(frozen=True)
class FamilyFacts:
    model_type: str
    expert_count_keys: tuple[str, ...]  # config.json keys holding the routed expert count, first present wins
    linear_names: tuple[str, ...]  # LoRA target names PEFT can match (leaf names of nn.Linear modules) ...
    text_config_key: str | None = None  # multimodal checkpoints: the text model's config lives under this key
    images: bool = False  # moetune feeds image rows through the family's processor (checkpoints with a vision tower)
    # ... of which these are absent from a model of the given (text) config
    absent_linears: Callable[[dict], tuple[str, ...]] = _none
    # model_types of released checkpoints of this family's architecture that transformers does not know
    release_model_types: tuple[str, ...] = ()

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

    def linears(self, config: dict) -> list[str]:
        """The leaf names of the linears LoRA may adapt in a model of this config.json."""
        absent = self.absent_linears(self.text_config(config))
        return sorted(set(self.linear_names) - set(absent))

    def unknown_targets(self, config: dict, targets: list[str]) -> list[str]:
        """Names that match no linear module of a model of this config.json (PEFT matches a name exactly or as a
        suffix)."""
        names = self.linears(config)
        return [t for t in targets if t.rsplit(".", 1)[-1] not in names]


FAMILIES: dict[str, FamilyFacts] = {f.model_type: f for f in (
    FamilyFacts("kimi_linear", ("num_experts", "num_local_experts"),
                _MLA + _MLP + ("k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj"),
                absent_linears=_mla_query_beside_kda),
    FamilyFacts("qwen3_moe", ("num_experts", "num_local_experts"), ("q_proj", "k_proj", "v_proj", "o_proj") + _MLP,
                absent_linears=_qwen3_moe_mlp),
    FamilyFacts("qwen3_next", ("num_experts",),
                ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj",
                 "shared_expert_gate") + _MLP),
    # Gated DeltaNet + gated attention under a vision tower (frozen); image rows go through its image processor.
    FamilyFacts("qwen3_5_moe", ("num_experts",),
                ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                 "out_proj", "shared_expert_gate") + _MLP, text_config_key="text_config", images=True),
    # Kimi-K2 / K2-Thinking ship DeepSeek-V3's architecture as model_type "kimi_k2" (their remote code is
    # DeepseekV3ForCausalLM; transformers reads that name only inside Kimi K2.5's text_config)
    FamilyFacts("deepseek_v3", ("n_routed_experts",), _MLA + _MLP, absent_linears=_mla_query,
                release_model_types=("kimi_k2",)),
    # DeepSeek-V3.2: DeepSeek-V3 plus the DSA indexer's own linears
    FamilyFacts("deepseek_v32", ("n_routed_experts",), _MLA + _MLP + ("wq_b", "wk", "weights_proj"),
                absent_linears=_mla_query),
    # Nemotron-H: Mamba2 mixers (in_proj; PEFT refuses their out_proj), attention, and latent MoE (plain up/down
    # experts working at moe_latent_size between fc1/fc2_latent_proj; a shared expert)
    FamilyFacts("nemotron_h", ("n_routed_experts",),
                ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj", "fc1_latent_proj",
                 "fc2_latent_proj")),
    # DeepSeek-V4: shared-KV attention (q_a/q_b, kv, grouped o_a -> o_b; PEFT cannot adapt the grouped o_a_proj)
    # whose compressors and indexer have their own kv/gate projections; shared and routed experts (every layer MoE)
    FamilyFacts("deepseek_v4", ("n_routed_experts",),
                ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "weights_proj") + _MLP),
    # Kimi K2.5: a DeepSeek-V3 text model (MLA + MoE) under a vision tower; text path only.
    FamilyFacts("kimi_k25", ("n_routed_experts",), _MLA + _MLP, text_config_key="text_config",
                absent_linears=_mla_query),
    # Every layer is MoE (no dense MLP); the router is not a linear; experts carry biases.
    FamilyFacts("gpt_oss", ("num_local_experts",), ("q_proj", "k_proj", "v_proj", "o_proj")),
    # KDA + DSA sparse MLA (its indexer's wq_b / wk / weights_proj) under a vision tower (frozen); image rows go
    # through its image processor.
    FamilyFacts("glm5_next", ("n_routed_experts",),
                _MLA + _MLP + ("k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
                               "wq_b", "wk", "weights_proj"), text_config_key="text_config", images=True,
                absent_linears=_mla_query_beside_kda),
    # Kimi K3: KDA (full-rank output gate g_proj) + NoPE MLA (sigmoid output gate g_proj), latent MoE
    # (routed_expert_down/up_proj around the experts); the Attention Residuals' *_res_proj weights are the mixes'
    # pseudo-queries, never called as linears (no LoRA). Its vision tower is not built (text path only).
    FamilyFacts("kimi_k3", ("num_experts",),
                _MLA + _MLP + ("k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj",
                               "routed_expert_down_proj", "routed_expert_up_proj"), text_config_key="text_config",
                absent_linears=_mla_query_beside_kda),
)}


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
    """config.json with a release's model_type (kimi_k2) replaced by its family's, the one transformers builds."""
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


def images_refusal(config: dict) -> str | None:
    """Why this checkpoint cannot train on rows with images, phrased to follow "but"; None when it can."""
    model_type = config.get("model_type")
    facts = known_facts(config)
    if facts is None or not facts.images:
        return f"moetune trains {model_type!r} models on text only (no image input for this family)"
    if "vision_config" not in config:
        return "the model has no vision tower (its config.json has no vision_config)"
    return None


def check_model_spec(config: dict, spec) -> None:
    """Rules that need the model's config.json; raises api.models.SpecError naming the field.

    `spec` is a resolved JobCreate. Used at submission (422) and again by the driver before workers start.
    """
    facts = facts_of(config)  # a malformed field or an unsupported model before the family's own rules
    lora = spec.lora
    spec.parallelism.check_expert_split(facts.num_experts(config))
    if lora.vision != "none" and (why := images_refusal(config)):
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
