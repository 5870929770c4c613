"""FP8 block quantization (DeepSeek-V3, Kimi-K2, Qwen3-FP8): float8_e4m3fn codes, one fp32 `weight_scale_inv` per
b0×b1 block; edge blocks are zero-padded, so the scale grid is [ceil(out/b0), ceil(in/b1)].
Reference: deepseek-ai/DeepSeek-V3 README_WEIGHTS.md and inference/kernel.py (weight_dequant); transformers'
FineGrainedFP8 quantizer dequantizes the same way (fp32 product, one rounding)."""

from __future__ import annotations

import dataclasses
import math

import torch

from moetune.kernels.quant.weight import QuantizedWeight

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


@dataclasses.dataclass(frozen=True, eq=False)
class Fp8BlockWeight(QuantizedWeight):
    weight: torch.Tensor  # float8_e4m3fn [..., out, in]
    weight_scale_inv: torch.Tensor  # fp32 [..., ceil(out/b0), ceil(in/b1)]
    block: tuple[int, int] = (128, 128)  # config.json quantization_config.weight_block_size

    def __post_init__(self):
        rows, cols = self.weight.shape[-2:]
        grid = (math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))
        if self.weight_scale_inv.shape != (*self.weight.shape[:-2], *grid):
            raise ValueError(f"scale_inv {tuple(self.weight_scale_inv.shape)} does not match weight "
                             f"{tuple(self.weight.shape)} in {self.block} blocks")

    @property
    def row_align(self) -> int:
        return self.block[0]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def _dense(self, start, stop):
        b0, b1 = self.block
        cols = self.weight.shape[-1]
        scale = self.weight_scale_inv[..., start // b0:math.ceil(stop / b0), :].float()
        scale = scale.repeat_interleave(b0, -2)[..., :stop - start, :].repeat_interleave(b1, -1)[..., :cols]
        return self.weight[..., start:stop, :].float() * scale


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> Fp8BlockWeight:
    """Per block: scale = amax / 448 (1 for an all-zero block), codes = w / scale in e4m3, scale_inv = scale."""
    b0, b1 = block
    *lead, rows, cols = w.shape
    grid = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = w.new_zeros(*lead, grid[0] * b0, grid[1] * b1, dtype=torch.float32)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.unflatten(-1, (grid[1], b1)).unflatten(-3, (grid[0], b0))  # [..., R, b0, C, b1]
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    codes = codes.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols].contiguous()
    return Fp8BlockWeight(codes, scale.contiguous(), tuple(block))
