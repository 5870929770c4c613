"""Kimi K3 in transformers' conventions, with the release's module names (so PEFT target names and exported adapter
keys are the release's): `language_model.model.layers.{i}` decoder layers holding `self_attn` (KDA or NoPE MLA) and
`mlp` (layer 0, dense) or `block_sparse_moe` (latent MoE), under block Attention Residuals.

- KDA (`KimiK3DeltaAttention`): separate q/k/v projections, each through its own depthwise causal conv + SiLU;
  forget gate g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)) (A_log stored padded to a multiple of
  128 heads, as released); full-rank output gate `g_proj` through the gated RMSNorm `o_norm`.
- MLA (`KimiK3Attention`): no positional encoding (the rope slice of q and k is used as is), output multiplied by
  sigmoid(g_proj(x)) before o_proj.
- Attention Residuals: a layer's attention and MLP inputs are softmax mixes over the completed blocks' sums and the
  current block's running sum (one tensor per block, kept as a list: no per-layer copies of the history).
- MoE (`KimiK3MoE`): sigmoid router with bias-corrected (noaux_tc) selection; routed experts work at the latent
  width: routed_expert_down_proj -> experts (SiTU-GLU) -> routed_expert_norm -> routed_expert_up_proj; shared
  experts at full width.

The KDA core and short convs are this module's `chunk_kimi_delta_attention` / `causal_conv1d_fn` (transformers'
Kimi-Linear torch functions), so the KDA kernel swap (workers.families.kda) routes them like Kimi-Linear's.

Generation uses transformers' DynamicCache built from the config: a KDA layer keeps its three short-conv states (q, k,
v: `number_of_conv_states`) and its recurrent state; an MLA layer keeps its compressed latent and the shared rope slice
as keys / values (NoPE: nothing in them depends on the position; positions only shape the mask). Prefill runs the
chunked core, a one-token step with a cached state runs `kernels.kda.recurrent_kda` (every row at once; fla's
fused recurrent kernel on CUDA). The Attention-Residual mixes are per token: they carry nothing across tokens, so they
need no cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.kimi_linear.modeling_kimi_linear import (  # noqa: F401  (module-level: routed by the swap)
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_kimi_delta_attention,
    eager_attention_forward,
)

from moetune.kernels.kda import recurrent_kda
from moetune.workers.families.kimi_k3.configuration import KimiK3Config, KimiK3TextConfig, vision_settings
from moetune.workers.families.kimi_k3.vision import (KimiK3PatchMergerProjector, KimiK3VisionPositionEmbedding,
                                                    KimiK3VisionTower)


def _situ_glu_fp32(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    activated = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return activated * up


_ROWS = 8192  # rows per fp32 pass: at K3's expert width each fp32 temporary is 0.1-0.2 GB, whatever the row count


def _rows(t: torch.Tensor):
    """[..., C] as chunks of _ROWS rows of [rows, C] (views where `t` is contiguous)."""
    return t.reshape(-1, t.shape[-1]).split(_ROWS)


class _SituGlu(torch.autograd.Function):
    """SiTU-GLU that keeps only its input for the backward (in its own dtype: bf16 on GPUs) and reruns the fp32
    math there, under autograd, for the input's gradient; both passes go a block of rows at a time, so the fp32
    temporaries stay small. Autograd through the forward would keep the fp32 [N, 2I] input and four fp32 [N, I]
    intermediates: 4.8 GB per MoE layer at 4K tokens with K3's 16 routed experts a token, where the bf16 input is
    0.8 GB."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.beta, ctx.linear_beta = beta, linear_beta
        out = gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
        for rows, out_rows in zip(_rows(gate_up), _rows(out)):
            out_rows.copy_(_situ_glu_fp32(rows, beta, linear_beta))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        d_gate_up = gate_up.new_empty(gate_up.shape)
        with torch.enable_grad():
            for rows, grad_rows, d_rows in zip(_rows(gate_up), _rows(grad), _rows(d_gate_up)):
                upcast = rows.detach().float().requires_grad_()
                out = _situ_glu_fp32(upcast, ctx.beta, ctx.linear_beta)
                d_rows.copy_(torch.autograd.grad(out, upcast, grad_rows.float())[0])
        return d_gate_up, None, None


def situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU over [gate; up] halves, computed in fp32, returned in the input's dtype: beta·tanh(gate/beta)·
    sigmoid(gate) times the up half bounded by linear_beta·tanh(up/linear_beta)."""
    return _SituGlu.apply(gate_up, beta, linear_beta)


class KimiK3RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class KimiK3GatedRMSNorm(nn.Module):
    """KDA's `o_norm`: fp32 RMSNorm of each head's output times sigmoid of the full-rank output gate."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight.float()
        return (x * torch.sigmoid(gate.float())).to(hidden_states.dtype)


class KimiK3MLP(nn.Module):
    """The dense MLP of layer 0 and the shared experts: SiTU-GLU."""

    def __init__(self, config: KimiK3TextConfig, intermediate_size: int):
        super().__init__()
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        return self.down_proj(situ_glu(gate_up, self.beta, self.linear_beta))


class KimiK3Attention(nn.Module):
    """NoPE MLA with a sigmoid output gate."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_head_dim = self.nope + self.rope
        self.scaling = self.q_head_dim ** -0.5
        self.is_causal = True
        self.num_key_value_groups = 1
        self.attention_dropout = config.attention_dropout
        hidden = config.hidden_size
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiK3RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = KimiK3RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(hidden, self.num_heads * self.v_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                **kwargs):
        batch, length = hidden_states.shape[:2]
        if self.config.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        query = q.view(batch, length, self.num_heads, self.q_head_dim).transpose(1, 2)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).view(batch, 1, length, self.kv_lora_rank)
        k_rope = k_rope.view(batch, 1, length, self.rope)
        if cache is not None:  # cached compressed, as one-head keys / values (transformers' MLA convention)
            latent, k_rope = cache.update(latent, k_rope, self.layer_idx)
        seen = latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).view(batch, seen, self.num_heads, self.nope + self.v_dim)
        k_nope, value = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        key = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)  # NoPE: no rotary on the slice
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(self, query, key, value, attention_mask, scaling=self.scaling,
                           dropout=self.attention_dropout if self.training else 0.0, **kwargs)
        out = out.reshape(batch, length, -1) * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(out)


class KimiK3DeltaAttention(nn.Module):
    """KDA with K3's gates: separate q/k/v convs, a lower-bounded forget gate, a full-rank output gate."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.kda_heads, config.kda_head_dim
        self.lower_bound = float(config.linear_attn_config["gate_lower_bound"])
        width = config.linear_attn_config["short_conv_kernel_size"]
        hidden, proj = config.hidden_size, self.num_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(proj, proj, width, groups=proj, padding=width - 1, bias=False) for _ in range(3))
        # stored as released: one entry per head, padded with zeros to a multiple of 128 entries
        self.A_log = nn.Parameter(torch.zeros(-(-self.num_heads // 128) * 128))
        self.dt_bias = nn.Parameter(torch.zeros(proj))
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_proj = nn.Linear(hidden, proj, bias=False)
        self.o_norm = KimiK3GatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(proj, hidden, bias=False)

    def _conv(self, which: int, conv: nn.Conv1d, x: torch.Tensor, cache, step: bool, **kwargs) -> torch.Tensor:
        """The depthwise causal conv + SiLU over [B, T, D]; with a cache, its conv state `which` (0 q, 1 k, 2 v)
        supplies the window's earlier tokens and keeps the last ones."""
        x, weight, length = x.transpose(1, 2), conv.weight.squeeze(1), x.shape[1]
        if step:
            out = causal_conv1d_update(x, cache.get_conv_state(self.layer_idx, which), weight, activation="silu")
        else:
            if cache is not None:  # the cached window, then this forward's tokens (zeros before a first prefill)
                x = cache.update_conv_state(x, self.layer_idx, state_idx=which, conv_kernel_size=weight.shape[-1])
            out = causal_conv1d_fn(x, weight, activation="silu", **kwargs)[..., -length:]
        return out.transpose(1, 2)

    def forget_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Log-space decay per head and key channel, in [lower_bound, 0): fp32 [B, T, H, D]."""
        raw = self.f_b_proj(self.f_a_proj(hidden_states)).float() + self.dt_bias.float()
        raw = raw.unflatten(-1, (self.num_heads, self.head_dim))
        decay = self.A_log[: self.num_heads].float().exp()[:, None]
        return self.lower_bound * torch.sigmoid(decay * raw)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                **kwargs):
        """`attention_mask`: the [B, T] padding mask of this forward's tokens, or None (no padding); `cache`: a
        DynamicCache whose layer `layer_idx` holds this layer's conv and recurrent states."""
        if attention_mask is not None:  # padding enters neither a conv window nor the state (both start at zero)
            hidden_states = hidden_states * attention_mask[..., None].to(hidden_states.dtype)
        heads = (*hidden_states.shape[:2], self.num_heads, self.head_dim)
        state = None if cache is None else cache.get_recurrent_state(self.layer_idx)
        step = state is not None and hidden_states.shape[1] == 1
        query, key, value = (self._conv(i, conv, proj(hidden_states), cache, step, **kwargs).reshape(heads)
                             for i, (conv, proj) in enumerate(((self.q_conv1d, self.q_proj),
                                                               (self.k_conv1d, self.k_proj),
                                                               (self.v_conv1d, self.v_proj))))
        beta = torch.sigmoid(self.b_proj(hidden_states).float())
        gate = self.forget_gate(hidden_states)
        if step:
            out, state = recurrent_kda(query, key, value, gate, beta, initial_state=state, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
        else:
            out, state = chunk_kimi_delta_attention(query, key, value, g=gate, beta=beta, initial_state=state,
                                                    output_final_state=cache is not None,
                                                    use_qk_l2norm_in_kernel=True, **kwargs)
        if cache is not None:
            cache.update_recurrent_state(state.float(), self.layer_idx)
        out = self.o_norm(out.to(query.dtype), self.g_proj(hidden_states).reshape(heads)).to(hidden_states.dtype)
        return self.o_proj(out.flatten(-2))


class KimiK3TopkRouter(nn.Module):
    """Sigmoid scores; experts picked by score + e_score_correction_bias (noaux_tc, grouped), weighted by the plain
    score, renormalised and scaled."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_token, config.num_experts
        self.num_group, self.topk_group = config.num_expert_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.moe_renormalize, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor):
        logits = F.linear(hidden_states.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = (scores + self.e_score_correction_bias).unflatten(-1, (self.num_group, -1))
        groups = choice.topk(min(2, choice.shape[-1]), dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1)[1]
        keep = torch.zeros_like(choice[..., 0], dtype=torch.bool).scatter_(-1, groups, True)
        choice = choice.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
        indices = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(-1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, indices


class KimiK3Experts(nn.Module):
    """The routed experts at the latent width, fused as transformers' MoE families hold them: gate_up_proj
    [E, 2·moe_intermediate, latent] (w1 then w3 of each released expert) and down_proj [E, latent, moe_intermediate]
    (w2); SiTU-GLU between them."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.num_experts = config.num_experts
        latent, inner = config.routed_expert_hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inner, latent))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, latent, inner))
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        return situ_glu(gate_up, self.beta, self.linear_beta)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            h = self.act(F.linear(hidden_states[token], self.gate_up_proj[expert]))
            h = F.linear(h, self.down_proj[expert]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out


class KimiK3MoE(nn.Module):
    """Latent MoE: the router reads the full-width token; routed experts run between routed_expert_down_proj and
    routed_expert_norm -> routed_expert_up_proj (so tokens can cross an all-to-all at latent width)."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        latent = config.routed_expert_hidden_size
        self.gate = KimiK3TopkRouter(config)
        self.routed_expert_down_proj = nn.Linear(config.hidden_size, latent, bias=False)
        self.experts = KimiK3Experts(config)
        self.routed_expert_norm = KimiK3RMSNorm(latent, config.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(latent, config.hidden_size, bias=False)
        self.shared_experts = KimiK3MLP(config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.flatten(0, -2)
        _, weights, indices = self.gate(flat)
        routed = self.experts(self.routed_expert_down_proj(flat), indices, weights)
        out = self.routed_expert_up_proj(self.routed_expert_norm(routed)) + self.shared_experts(flat)
        return out.view_as(hidden_states)


def attn_res_mix(blocks: list[torch.Tensor], partial: torch.Tensor, norm: KimiK3RMSNorm, proj: nn.Linear):
    """One Attention-Residual mix: softmax over the sources (completed blocks, then the running block sum) of
    <RMSNorm(source), proj>, in fp32; the sources are never stacked."""
    if not blocks:
        return partial
    sources = [*blocks, partial]
    query = norm.weight.float() * proj.weight[0].float()
    eps = norm.variance_epsilon
    scores = torch.stack([(s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps) * query).sum(-1)
                          for s in sources], dim=-1).softmax(-1)
    mixed = sum(scores[..., i, None] * s.float() for i, s in enumerate(sources))
    return mixed.to(partial.dtype)


class KimiK3DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.starts_block = layer_idx % config.attn_res_block_size == 0
        self.is_linear = config.layer_types[layer_idx] == "linear_attention"
        self.self_attn = (KimiK3DeltaAttention if self.is_linear else KimiK3Attention)(config, layer_idx)
        if layer_idx < config.first_k_dense_replace:
            self.mlp = KimiK3MLP(config, config.intermediate_size)
        else:
            self.block_sparse_moe = KimiK3MoE(config)
        eps = config.rms_norm_eps
        self.input_layernorm = KimiK3RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = KimiK3RMSNorm(config.hidden_size, eps)
        self.self_attention_res_norm = KimiK3RMSNorm(config.hidden_size, eps)
        self.self_attention_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        self.mlp_res_norm = KimiK3RMSNorm(config.hidden_size, eps)
        self.mlp_res_proj = nn.Linear(config.hidden_size, 1, bias=False)

    def feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return (self.mlp if hasattr(self, "mlp") else self.block_sparse_moe)(hidden_states)

    def forward(self, partial: torch.Tensor, blocks: list[torch.Tensor], attention_mask=None, **kwargs):
        """`partial`: the running sum of this block's sub-layer outputs (the embeddings before layer 0); `blocks`:
        the sums of the completed blocks. Returns both, updated."""
        attn_input = attn_res_mix(blocks, partial, self.self_attention_res_norm, self.self_attention_res_proj)
        if self.starts_block:
            blocks, partial = [*blocks, partial], None
        attn_out = self.self_attn(self.input_layernorm(attn_input), attention_mask=attention_mask, **kwargs)
        partial = attn_out if partial is None else partial + attn_out
        mlp_input = attn_res_mix(blocks, partial, self.mlp_res_norm, self.mlp_res_proj)
        mlp_out = self.feed_forward(self.post_attention_layernorm(mlp_input))
        return partial + mlp_out, blocks


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3TextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _can_compile_fullgraph = False
    _is_stateful = True  # KDA's recurrent state cannot be rolled back (no assisted decoding, no cache cropping)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, KimiK3DeltaAttention):
            module.A_log.zero_()
            module.A_log[: module.num_heads].uniform_(1, 16).log_()
            module.dt_bias.zero_()
        elif isinstance(module, KimiK3TopkRouter):
            module.weight.normal_(0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, KimiK3Experts):
            module.gate_up_proj.normal_(0, std)
            module.down_proj.normal_(0, std)
        elif isinstance(module, (KimiK3RMSNorm, KimiK3GatedRMSNorm, nn.RMSNorm)):
            module.weight.fill_(1.0)
        elif isinstance(module, KimiK3VisionPositionEmbedding):
            module.weight.normal_(0, std)


class KimiK3TextModel(KimiK3PreTrainedModel):
    def __init__(self, config: KimiK3TextConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.output_attn_res_norm = KimiK3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        self.norm = KimiK3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, cache=None,
                use_cache=None, **kwargs):
        """`attention_mask`: [B, cached + T], 0 on (left) padding; `cache`: the DynamicCache to read and extend
        (one is made when `use_cache` asks and none is given)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            seen = 0 if cache is None else cache.get_seq_length()
            position_ids = torch.arange(seen, seen + inputs_embeds.shape[1], device=inputs_embeds.device)[None]
        masks = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                 "cache": cache}
        causal = create_causal_mask(**masks, position_ids=position_ids)
        padding = create_recurrent_attention_mask(**masks)
        partial, blocks = inputs_embeds, []
        for layer in self.layers:
            partial, blocks = layer(partial, blocks, attention_mask=padding if layer.is_linear else causal,
                                    cache=cache, **kwargs)
        hidden = attn_res_mix(blocks, partial, self.output_attn_res_norm, self.output_attn_res_proj)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), cache=cache)


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {}

    def __init__(self, config: KimiK3TextConfig):
        super().__init__(config)
        self.model = KimiK3TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                logits_to_keep: int = 0, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(out.last_hidden_state[:, keep])
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel, GenerationMixin):
    """The release's top level: `language_model.` (the text model + lm_head), and with a vision_config the MoonViT3d
    tower (`vision_tower.`) and its projector (`mm_projector.`). Image rows carry one placeholder token
    (`media_placeholder_token_id`) per image token, already expanded (workers.methods.multimodal): each takes one
    projected image feature, in order."""

    config_class = KimiK3Config
    base_model_prefix = "language_model"
    _tied_weights_keys = {}

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.language_model = KimiK3ForCausalLM(config.text_config)
        if config.vision_config is not None:
            settings = vision_settings(config.vision_config)
            self.vision_tower = KimiK3VisionTower(settings)
            self.mm_projector = KimiK3PatchMergerProjector(settings, config.text_config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.lm_head

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """[image tokens, hidden]: every image's projected tokens, images in order."""
        if not hasattr(self, "vision_tower"):
            raise ValueError("image inputs given to a Kimi K3 checkpoint without a vision_config (text only)")
        return self.mm_projector(self.vision_tower(pixel_values, image_grid_thw))

    def _with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor):
        embeds = self.get_input_embeddings()(input_ids)
        features = self.get_image_features(pixel_values, image_grid_thw)
        placeholders = input_ids == self.config.media_placeholder_token_id
        if int(placeholders.sum()) != features.shape[0]:
            raise ValueError(f"{int(placeholders.sum())} image placeholder tokens in input_ids, but the images give "
                             f"{features.shape[0]} image tokens")
        return embeds.masked_scatter(placeholders[..., None], features.to(embeds.dtype))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                logits_to_keep: int = 0, pixel_values=None, image_grid_thw=None, mm_token_type_ids=None, **kwargs):
        """`pixel_values` [patches, 3, patch, patch] and `image_grid_thw` [images, 3] with the images of the
        batch's rows in order (`mm_token_type_ids`, which the shared image path adds, is not needed: the
        placeholders say where images go)."""
        if pixel_values is not None:
            inputs_embeds, input_ids = self._with_images(input_ids, pixel_values, image_grid_thw), None
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, labels=labels, logits_to_keep=logits_to_keep,
                                   **kwargs)


def _experts_conversion() -> list[WeightConverter]:
    """The release's per-expert w1 / w3 / w2 tensors into the fused experts (transformers' loader and moetune's
    streaming loader both read this)."""
    experts = "block_sparse_moe.experts"
    return [
        WeightConverter(source_patterns=[f"{experts}.*.w1.weight", f"{experts}.*.w3.weight"],
                        target_patterns=f"{experts}.gate_up_proj",
                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns=f"{experts}.*.w2.weight", target_patterns=f"{experts}.down_proj",
                        operations=[MergeModulelist(dim=0)]),
    ]


for _name in ("KimiK3ForConditionalGeneration", "KimiK3ForCausalLM"):
    register_checkpoint_conversion_mapping(_name, _experts_conversion(), overwrite=True)
