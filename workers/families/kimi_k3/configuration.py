"""Kimi K3's config.json as released: a `kimi_k3` top level with the language model in a nested `text_config`
(its layer kinds as 1-indexed lists under `linear_attn_config`) and the vision tower's in `vision_config`.
transformers has no class for it; these follow transformers' dataclass configs."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig


@strict
class KimiK3TextConfig(PreTrainedConfig):
    """The text model: KDA and NoPE MLA layers, block Attention Residuals, latent MoE with SiTU-GLU experts. Defaults
    are the release's (93 layers: 69 KDA + 24 MLA, hidden 7168, 896 experts, 16 active, 2 shared)."""

    model_type = "kimi_k3_text"
    # names moetune's generic code (and transformers' MoE helpers) read, onto the release's own keys
    attribute_map = {"num_local_experts": "num_experts", "n_routed_experts": "num_experts",
                     "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts",
                     "norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group"}

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 33792
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int | None = None
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    max_position_embeddings: int = 1048576
    # MoE
    moe_intermediate_size: int = 3072
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    # MLA (full-attention layers)
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # KDA layers and the residual mix
    linear_attn_config: dict | None = None
    attn_res_block_size: int = 12
    num_nextn_predict_layers: int = 0
    layer_types: list[str] | None = None  # derived from linear_attn_config's 1-indexed lists

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.linear_attn_config is None:
            full = [i for i in range(4, self.num_hidden_layers + 1, 4)]
            full += [self.num_hidden_layers] if self.num_hidden_layers % 4 else []
            self.linear_attn_config = {
                "head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4, "full_attn_layers": full,
                "kda_layers": [i for i in range(1, self.num_hidden_layers + 1) if i not in full],
                "use_full_rank_gate": True, "gate_lower_bound": -5.0}
        lists = self.linear_attn_config
        kinds = {**dict.fromkeys(lists["kda_layers"], "linear_attention"),
                 **dict.fromkeys(lists["full_attn_layers"], "full_attention")}
        if sorted(kinds) != list(range(1, self.num_hidden_layers + 1)) or \
                len(lists["kda_layers"]) + len(lists["full_attn_layers"]) != self.num_hidden_layers:
            raise ValueError("linear_attn_config: kda_layers and full_attn_layers must name every layer 1.."
                             f"{self.num_hidden_layers} exactly once")
        self.layer_types = [kinds[i] for i in range(1, self.num_hidden_layers + 1)]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Only the variant the release uses: anything else would load and compute something else."""
        super().validate_architecture()
        lists = self.linear_attn_config
        unsupported = {
            "mla_use_nope": not self.mla_use_nope, "mla_use_output_gate": not self.mla_use_output_gate,
            "linear_attn_config.use_full_rank_gate": not lists.get("use_full_rank_gate"),
            "linear_attn_config.gate_lower_bound": lists.get("gate_lower_bound") is None,
            "moe_router_activation_func": self.moe_router_activation_func != "sigmoid",
            "topk_method": self.topk_method != "noaux_tc", "hidden_act": self.hidden_act != "situ",
            "num_nextn_predict_layers": self.num_nextn_predict_layers != 0,
        }
        if bad := [name for name, refused in unsupported.items() if refused]:
            raise ValueError(f"Kimi K3 text_config: {', '.join(bad)} differ from the released architecture, "
                             "which is the only one moetune defines")

    @property
    def number_of_conv_states(self) -> int:
        """KDA's short convs run apart (q, k, v): transformers' cache keeps one conv state for each."""
        return 3

    @property
    def kda_heads(self) -> int:
        return self.linear_attn_config["num_heads"]

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config["head_dim"]


@strict
class KimiK3Config(PreTrainedConfig):
    """The release's top level (`KimiK3ForConditionalGeneration`)."""

    model_type = "kimi_k3"
    sub_configs_defaults = {"text_config": KimiK3TextConfig}

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | None = None  # MoonViT3d + patchmergerv2, as released (`vision_settings` reads it)
    media_placeholder_token_id: int = 163605
    ignore_index: int = -100
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if isinstance(self.text_config, dict):
            # the release writes Kimi-Linear's model_type for its text model: it is a K3 text model here
            self.text_config = {k: v for k, v in self.text_config.items() if k != "model_type"}
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        super().validate_architecture()
        if self.vision_config is not None:
            vision_settings(self.vision_config)


# The release's vision_config keys and their defaults (NeMo Automodel's KimiK3VisionConfig): MoonViT3d with 27
# layers x 1024, fused wqkv at 1536, RMSNorm, no biases, and the patchmergerv2 projector with its post-norm.
VISION_DEFAULTS = {
    "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear", "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27, "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "qkv_hidden_size": 1536,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
    "mm_hidden_size": None, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "norm_type": "rmsnorm",
    "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False, "linear_bias": False,
    "patch_embed_proj_bias": False,
}
# the one variant moetune builds: any other value would load and compute something else
_VISION_RELEASED = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
                    "projector_hidden_act": "gelu", "norm_type": "rmsnorm", "mlp_type": "mlp2",
                    "activation_func": "gelu_pytorch_tanh"}


def vision_settings(vision_config: dict) -> dict:
    """The released vision_config with its defaults filled in; a variant moetune does not build is refused by name."""
    settings = {**VISION_DEFAULTS, **vision_config}
    settings["mm_hidden_size"] = settings["mm_hidden_size"] or settings["vt_hidden_size"]
    bad = [f"vision_config.{key}={settings[key]!r} (released: {value!r})" for key, value in _VISION_RELEASED.items()
           if settings[key] != value]
    if settings["mm_hidden_size"] != settings["vt_hidden_size"]:
        bad.append("vision_config.mm_hidden_size differs from vt_hidden_size")
    if bad:
        raise ValueError(f"Kimi K3 {', '.join(bad)}: only the released vision tower is defined")
    return settings


__all__ = ["KimiK3Config", "KimiK3TextConfig"]
