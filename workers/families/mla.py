"""MLA attention: dense through SDPA at the key width (every MLA family's full attention), and sparse over the shared
latent (the "absorbed" form), for the families whose DSA attention is MLA (their swaps call it).

Dense: an MLA key (qk_nope + rope, 192 in the releases) is wider than its value (128). PyTorch's fused SDPA kernels
want one width; on CPU an unequal one falls back to the math path, which keeps the whole [B, H, T, T] attention
matrix for the backward. `sdpa_at_key_width` pads the value with zeros to the key width and cuts the output back:
the same numbers (the padded output columns are zero and dropped), on the fused kernel.

Sparse:
transformers expands the latent per head before attention (`expand_kv`: kv_b_proj gives every head its own keys
and values), so a sparse kernel gathers, for each query and head, that head's rows: 64-128 gathers of the same
token per query. Absorbed, every head attends over the latent itself:
    score_h(t, s) = (W_UK[h]ᵀ q_nope[t, h]) · c_s + q_rope[t, h] · k_rope[s]      out_h = W_UV[h] Σ_s p_h(t, s) c_s
with W_UK / W_UV the key and value halves of kv_b_proj per head and c_s the normalised latent of token s. The
kernel then sees one kv head (latent | RoPE key) whose first columns are also the values, and one gathered row
serves every head (the structure DeepSeek's DSA and FlashMLA's sparse kernels use). The math is the same; only the
rounding order differs.

kv_b_proj's matrix is read as its output for the identity, so a LoRA adapter on it (and a quantized base weight)
is folded in and receives its gradients through it. A LoRA dropout inside kv_b_proj (while training) draws a mask
per token, which no single matrix reproduces: each such adapter's per-token u_s = A·dropout(c_s) then joins the
latent, [c_s, u_s], and s·B joins the matrix: exact, the same dropout draws as transformers' expanded form.
A kv_b_proj whose weights differ by batch row (the serving engine's mixed adapters) keeps the expanded form.
"""

from __future__ import annotations

import types

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from moetune.kernels.sparse_attention import sparse_attention


def sdpa_at_key_width(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention (same signature, [B, T, H, Dv] out) with a value narrower than the key padded to
    the key's width for the kernel and the output cut back to the value's."""
    width = value.shape[-1]
    if width < key.shape[-1]:
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - width))
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return out[..., :width], weights


def _dropouts_active(proj) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in proj.modules())


def _per_token_adapters(proj) -> list[tuple] | None:
    """The (A, B, dropout, scaling) of each active adapter of a PEFT LoRA linear, in PEFT's order; None when
    `proj` is not a plain-LoRA PEFT linear."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(proj, LoraLayer) or proj.merged or proj.disable_adapters:
        return None
    names = [n for n in proj.active_adapters if n in proj.lora_A]
    if any(n in getattr(proj, "lora_variant", {}) for n in names):  # DoRA and other variants: not one matrix
        return None
    return [(proj.lora_A[n], proj.lora_B[n], proj.lora_dropout[n], proj.scaling[n]) for n in names]


def _absorption(module) -> list[tuple] | None:
    """How kv_b_proj absorbs now: [] (as one matrix), the adapters whose inputs stay per token (their dropout is
    active), or None (not absorbable: per-row weights, or a dropout inside something that is not plain LoRA)."""
    proj = module.kv_b_proj
    if getattr(proj, "varies_by_row", False):
        return None
    if not _dropouts_active(proj):
        return []
    return _per_token_adapters(proj)


def _latent_kv(module, kv_nope: torch.Tensor, k_rot: torch.Tensor):
    """In place of `expand_kv`: keys [B, 1, S, r (+ adapters' u) + rope] = latent | adapters' u | RoPE key, and
    the values = its first r (+ u) columns; transformers' per-head expansion when kv_b_proj does not absorb."""
    adapters = _absorption(module)
    if adapters is None:
        return type(module).expand_kv(module, kv_nope, k_rot)
    per_token = [a(dropout(kv_nope.to(a.weight.dtype))).to(kv_nope.dtype) for a, _, dropout, _ in adapters]
    latent = torch.cat([kv_nope, *per_token], dim=-1)
    return torch.cat([latent, k_rot], dim=-1), latent


def use_latent_kv(module) -> None:
    """Make `module` (an MLA attention with transformers' expand_kv) hand its latent to the attention function."""
    module.expand_kv = types.MethodType(_latent_kv, module)


def _kv_b_matrix(module, adapters: list[tuple], like: torch.Tensor) -> torch.Tensor:
    """kv_b_proj as [H, nope + v, latent width]: its output for the identity (bias-free in every MLA model), or
    with per-token adapters, the base layer's followed by each adapter's s·B."""
    eye = torch.eye(module.kv_lora_rank, dtype=like.dtype, device=like.device)
    proj = module.kv_b_proj
    if not adapters:
        matrix = proj(eye).t()
    else:
        matrix = torch.cat([proj.base_layer(eye).t(), *(b.weight.to(like.dtype) * s for _, b, _, s in adapters)], 1)
    return matrix.reshape(module.num_heads, module.qk_nope_head_dim + module.v_head_dim, -1)


def mla_sparse_attention(module, query, key, value, indices, scaling) -> torch.Tensor:
    """Attention of each query over its selected tokens; [B, T, H, v_head_dim].
    query [B, H, T, nope + rope] as transformers builds it; key/value as `_latent_kv` returned them."""
    backend = module.sparse_attention_backend
    adapters = _absorption(module)
    if adapters is None:
        return sparse_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), indices,
                                scale=scaling, backend=backend)
    w_uk, w_uv = _kv_b_matrix(module, adapters, key).split([module.qk_nope_head_dim, module.v_head_dim], dim=1)
    q_nope, q_rope = query.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    q = torch.cat([torch.einsum("bhtn,hnr->bthr", q_nope, w_uk), q_rope.transpose(1, 2)], dim=-1)
    latent = key.transpose(1, 2)  # [B, S, 1, width + rope]
    out = sparse_attention(q, latent, latent[..., :value.shape[-1]], indices, scale=scaling, backend=backend)
    return torch.einsum("bthr,hvr->bthv", out, w_uv)
