"""MXFP4 (gpt-oss experts): e2m1 codes, two per byte (low nibble = even element), 32 per group sharing one e8m0
scale, value = E2M1[code] * 2**(scale - 127). gpt-oss stores `<proj>_blocks` [..., out, in/32, 16] and
`<proj>_scales` [..., out, in/32], rows being the output features (transformers' parameter is the transpose).
Reference: OCP Microscaling Formats (MX) v1.0; transformers/integrations/mxfp4.py (FP4_VALUES,
convert_moe_packed_tensors); the scale rule of triton_kernels' downcast_to_mxfp_torch."""

from __future__ import annotations

import dataclasses

import torch

from moetune.kernels.quant.weight import QuantizedWeight

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32


@dataclasses.dataclass(frozen=True, eq=False)
class Mxfp4Weight(QuantizedWeight):
    blocks: torch.Tensor  # uint8 [..., out, in/32, 16]
    scales: torch.Tensor  # uint8 e8m0 [..., out, in/32]

    def __post_init__(self):
        if self.blocks.shape[:-1] != self.scales.shape or self.blocks.shape[-1] != GROUP // 2:
            raise ValueError(f"blocks {tuple(self.blocks.shape)} and scales {tuple(self.scales.shape)} "
                             "are not [..., out, in/32, 16] and [..., out, in/32]")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.scales.shape[:-1], self.scales.shape[-1] * GROUP))

    def _dense(self, start, stop):
        # fp32 holds every LUT value times any e8m0 power exactly (bf16 too: the same exponent range)
        blocks = self.blocks[..., start:stop, :, :]
        codes = torch.stack((blocks & 0xF, blocks >> 4), -1).flatten(-2).long()
        values = torch.tensor(E2M1, device=blocks.device)[codes]
        exponent = self.scales[..., start:stop, :, None].to(torch.int32) - 127
        return torch.ldexp(values, exponent).flatten(-2)


def quantize_mxfp4(w: torch.Tensor) -> Mxfp4Weight:
    """Scale: the smallest power of two with amax / scale <= 6 (amax / 6 rounded up in fp32 bits); codes: the
    nearest e2m1 value, ties to the even code, +-6 saturating."""
    g = w.float().unflatten(-1, (-1, GROUP))
    bits = ((g.abs().amax(-1) / 6).view(torch.int32) + 0x7FFFFF) & 0x7F800000
    scales = (bits >> 23).clamp(max=254).to(torch.uint8)
    magnitude = torch.ldexp(g, 127 - scales[..., None].to(torch.int32)).abs().clamp(max=6)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=g.device)
    lower, upper = (torch.bucketize(magnitude, midpoints, right=right) for right in (False, True))
    index = torch.where(lower % 2 == 0, lower, upper)  # a tie sits between two codes: take the even one
    codes = torch.where(index == 0, 0, index | (torch.signbit(g).long() << 3)).to(torch.uint8)
    return Mxfp4Weight((codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales.contiguous())
