"""Kimi K3's vision side with the release's module names: the MoonViT3d tower (`vision_tower.`) and the
`patchmergerv2` projector (`mm_projector.`).

- Patches arrive as [patches, 3, patch, patch], each image's in (frame, row, column) raster order; `image_grid_thw`
  gives each image's (frames, rows, columns) of patches.
- `patch_embed`: a patch-sized conv, plus a learned [height, width, dim] position table resized bilinearly to the
  image's grid (and, for several frames, a fixed sin-cos time embedding per frame).
- `encoder.blocks`: pre-norm (RMSNorm) blocks; attention through the fused `wqkv` with a 2D rotary on q and k (the
  column angle on even complex pairs, the row angle on odd ones), each image attending to itself only; GELU-tanh MLP.
- Pooling (`sd2_tpool`): 2x2 neighbouring patches become one token (their features side by side), averaged over
  frames; the projector maps that to the text width and RMS-normalises after (its post-norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class KimiK3VisionPositionEmbedding(nn.Module):
    """`patch_embed.pos_emb`: the learned [height, width, dim] table, resized to each image's grid (the time
    embedding is computed, not stored: the release holds no tensor for it)."""

    def __init__(self, settings: dict):
        super().__init__()
        dim = settings["vt_hidden_size"]
        self.mode, self.max_frames = settings["pos_emb_interpolation_mode"], settings["init_pos_emb_time"]
        self.weight = nn.Parameter(torch.empty(settings["init_pos_emb_height"], settings["init_pos_emb_width"], dim))

    def forward(self, grid_thw: torch.Tensor) -> torch.Tensor:
        embeddings = []
        for frames, rows, columns in grid_thw.tolist():
            if frames > self.max_frames:
                raise ValueError(f"an image of {frames} frames: the vision tower takes at most {self.max_frames}")
            table = self.weight
            if (rows, columns) != tuple(table.shape[:2]):
                table = F.interpolate(table.permute(2, 0, 1)[None], size=(rows, columns), mode=self.mode)[0]
                table = table.permute(1, 2, 0)
            table = table.flatten(0, 1)
            if frames > 1:
                time = _sincos_time_embedding(table.shape[-1], frames).to(table.device, table.dtype)
                table = (table[None] + time).flatten(0, 1)
            embeddings.append(table)
        return torch.cat(embeddings)


def _sincos_time_embedding(dim: int, frames: int) -> torch.Tensor:
    """[frames, 1, dim]: sin of frame·ω then cos of it, ω_i = 10000^(-2i/dim)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32) / (dim / 2))
    angles = torch.arange(frames, dtype=torch.float32)[:, None] * omega
    return torch.cat((angles.sin(), angles.cos()), dim=-1)[:, None]


class KimiK3VisionPatchEmbed(nn.Module):
    def __init__(self, settings: dict):
        super().__init__()
        patch = settings["patch_size"]
        self.proj = nn.Conv2d(3, settings["vt_hidden_size"], kernel_size=patch, stride=patch,
                              bias=settings["patch_embed_proj_bias"])
        self.pos_emb = KimiK3VisionPositionEmbedding(settings)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values).flatten(1) + self.pos_emb(grid_thw)


def rotary_2d(grid_thw: torch.Tensor, head_dim: int, device: torch.device, theta: float = 10000.0) -> torch.Tensor:
    """Complex [patches, head_dim/2]: for frequency i, entry 2i turns by column·f_i and 2i+1 by row·f_i,
    f_i = theta^(-4i/head_dim); every frame of an image gets its grid's angles."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim)
    angles = []
    for frames, rows, columns in grid_thw.tolist():
        row = torch.arange(rows, device=device).float().repeat_interleave(columns)
        column = torch.arange(columns, device=device).float().repeat(rows)
        pair = torch.stack((torch.outer(column, freqs), torch.outer(row, freqs)), dim=-1).flatten(-2)
        angles.append(pair.repeat(frames, 1))
    angles = torch.cat(angles)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """x [patches, heads, head_dim] turned by `rotary` (consecutive channels as complex pairs), in fp32."""
    turned = torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * rotary[:, None]
    return torch.view_as_real(turned).flatten(-2).type_as(x)


class KimiK3VisionMLP(nn.Module):
    def __init__(self, settings: dict):
        super().__init__()
        hidden, bias = settings["vt_hidden_size"], settings["linear_bias"]
        self.fc0 = nn.Linear(hidden, settings["vt_intermediate_size"], bias=bias)
        self.fc1 = nn.Linear(settings["vt_intermediate_size"], hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class KimiK3VisionBlock(nn.Module):
    """`encoder.blocks.{i}`: norm0 -> attention (fused wqkv, 2D rotary) -> wo; norm1 -> MLP; residual around both."""

    def __init__(self, settings: dict):
        super().__init__()
        hidden, inner = settings["vt_hidden_size"], settings["qkv_hidden_size"]
        self.num_heads = settings["vt_num_attention_heads"]
        self.norm0 = nn.RMSNorm(hidden)
        self.norm1 = nn.RMSNorm(hidden)
        self.wqkv = nn.Linear(hidden, 3 * inner, bias=settings["attn_bias"])
        self.wo = nn.Linear(inner, hidden, bias=settings["attn_bias"])
        self.mlp = KimiK3VisionMLP(settings)

    def attention(self, x: torch.Tensor, lengths: list[int], rotary: torch.Tensor) -> torch.Tensor:
        query, key, value = self.wqkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        query, key = _rotate(query, rotary), _rotate(key, rotary)
        out = [F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
               for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths))]  # image by image
        return self.wo(torch.cat(out).flatten(-2))

    def forward(self, x: torch.Tensor, lengths: list[int], rotary: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), lengths, rotary)
        return x + self.mlp(self.norm1(x))


class KimiK3VisionEncoder(nn.Module):
    def __init__(self, settings: dict):
        super().__init__()
        self.head_dim = settings["qkv_hidden_size"] // settings["vt_num_attention_heads"]
        if self.head_dim % 4:
            raise ValueError(f"vision_config: a head of {self.head_dim} channels; the 2D rotary needs a multiple of 4")
        self.blocks = nn.ModuleList(KimiK3VisionBlock(settings) for _ in range(settings["vt_num_hidden_layers"]))
        self.final_layernorm = nn.RMSNorm(settings["vt_hidden_size"])

    def forward(self, x: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        rotary = rotary_2d(grid_thw, self.head_dim, x.device)
        lengths = grid_thw.prod(-1).tolist()
        for block in self.blocks:
            x = block(x, lengths, rotary)
        return self.final_layernorm(x)


def pool_patches(x: torch.Tensor, grid_thw: torch.Tensor, kernel: tuple[int, int]) -> torch.Tensor:
    """[tokens, kh·kw·dim]: each kh x kw window of an image's patches side by side (row-major within the window),
    windows in raster order, averaged over the image's frames."""
    kh, kw = kernel
    pooled = []
    for (frames, rows, columns), patches in zip(grid_thw.tolist(), x.split(grid_thw.prod(-1).tolist())):
        if rows % kh or columns % kw:
            raise ValueError(f"an image of {rows}x{columns} patches: the vision tower merges {kh}x{kw} windows")
        windows = patches.view(frames, rows // kh, kh, columns // kw, kw, -1).permute(0, 1, 3, 2, 4, 5).mean(0)
        pooled.append(windows.flatten(0, 1).flatten(1))
    return torch.cat(pooled)


class KimiK3VisionTower(nn.Module):
    """`vision_tower`: MoonViT3d, to pooled tokens [tokens, kh·kw·vt_hidden_size]."""

    def __init__(self, settings: dict):
        super().__init__()
        self.merge_kernel_size = tuple(settings["merge_kernel_size"])
        self.patch_embed = KimiK3VisionPatchEmbed(settings)
        self.encoder = KimiK3VisionEncoder(settings)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        pixel_values = pixel_values.to(self.patch_embed.proj.weight.dtype)
        x = self.encoder(self.patch_embed(pixel_values, grid_thw), grid_thw)
        return pool_patches(x, grid_thw, self.merge_kernel_size)


class KimiK3PatchMergerProjector(nn.Module):
    """`mm_projector` (patchmergerv2): Linear -> GELU -> Linear to the text width, then RMSNorm (the post-norm)."""

    def __init__(self, settings: dict, text_hidden_size: int):
        super().__init__()
        kh, kw = settings["merge_kernel_size"]
        width = settings["mm_hidden_size"] * kh * kw
        self.proj = nn.Sequential(nn.Linear(width, width, bias=False), nn.GELU(),
                                  nn.Linear(width, text_hidden_size, bias=False))
        self.post_norm = nn.RMSNorm(text_hidden_size, eps=settings["projector_ln_eps"])

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(pooled))
