"""INT4 in compressed-tensors' "pack-quantized" format (Kimi K2 Thinking, K2.5): signed 4-bit codes in groups along
the input dim, eight per int32 word, element i of a row at bits 4*(i%8) of word i//8 (lowest first), stored as q+8;
on a little-endian host byte c//2 holds element c, low nibble for even c. An asymmetric scheme adds a zero point
packed the same way along the output dim. Checkpoints also carry `weight_shape` ([out, in], int64), implied here.
Reference: compressed_tensors/compressors/pack_quantized (pack_to_int32) and quantization/lifecycle/forward.py
(_quantize/_dequantize: the product in the scale's dtype, bf16, rounded once; computed here exactly in fp32, then
cast)."""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F

from moetune.kernels.quant.weight import QuantizedWeight


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., k] -> int8 [..., 8k] in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed[..., None] >> shifts) & 0xF).flatten(-2).to(torch.int8) - 8


def _pack(q: torch.Tensor) -> torch.Tensor:
    """int [..., n] in [-8, 7] -> int32 [..., ceil(n/8)]; padding nibbles are 0, as compressed-tensors writes."""
    assert sys.byteorder == "little", "four bytes are viewed as their int32 word"
    codes = F.pad((q + 8).to(torch.uint8), (0, -q.shape[-1] % 8))
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous().view(torch.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Int4PackedWeight(QuantizedWeight):
    weight_packed: torch.Tensor  # int32 [..., out, in/8]
    weight_scale: torch.Tensor  # bf16 [..., out, in/group]
    weight_zero_point: torch.Tensor | None = None  # asymmetric only: int32 [..., ceil(out/8), in/group]

    def __post_init__(self):
        scale, packed = self.weight_scale.shape, self.weight_packed.shape
        if scale[:-1] != packed[:-1] or self.shape[-1] % scale[-1]:
            raise ValueError(f"weight_scale {tuple(scale)} does not group weight_packed {tuple(packed)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.weight_packed.shape[:-1], self.weight_packed.shape[-1] * 8))

    def _dense(self, start, stop):
        # In fp32 the product of a 4-bit code and a bf16 scale is exact; cast to bf16 it rounds once, which is
        # bit for bit compressed-tensors' product in bf16, and fp32 compute gets the exact value.
        scale = self.weight_scale[..., start:stop, :, None].float()
        x = _unpack(self.weight_packed[..., start:stop, :]).unflatten(-1, (scale.shape[-2], -1)).float()
        if self.weight_zero_point is not None:
            word = start // 8
            zp = _unpack(self.weight_zero_point[..., word:-(-stop // 8), :].transpose(-1, -2)).transpose(-1, -2)
            x = x - zp[..., start - 8 * word:stop - 8 * word, :, None].float()
        return (x * scale).flatten(-2)


def quantize_int4(w: torch.Tensor, group: int = 32, symmetric: bool = True) -> Int4PackedWeight:
    """compressed-tensors' min/max observer in bf16: symmetric scale = amax / 7.5, asymmetric scale =
    (max - min) / 15 with zero point round(-8 - min / scale); q = round(w / scale [+ zp]) clamped to [-8, 7]."""
    g = w.to(torch.bfloat16).unflatten(-1, (-1, group))
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = torch.maximum(-lo, hi) / 7.5 if symmetric else (hi - lo) / 15
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    zp = None if symmetric else (-8 - lo / scale).clamp(-8, 7).round()
    scaled = g / scale[..., None] + (0 if symmetric else zp[..., None])
    q = scaled.round().clamp(-8, 7).flatten(-2)
    packed_zp = None if symmetric else _pack(zp.transpose(-1, -2)).transpose(-1, -2).contiguous()
    return Int4PackedWeight(_pack(q), scale, packed_zp)
