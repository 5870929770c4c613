"""The frozen, still-quantized weight every format shares: its stored tensors (checkpoint names and dtypes), their
movement, per-expert views and row-tile dequantization. A format adds its tensors, `shape` and `_dense`."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A frozen [..., out, in] weight in its checkpoint form. Rows are dequantized on demand, a tile at a time, so
    the dense weight never exists whole. To hold one in an nn.Module, register `tensors()` as buffers (then
    `.to(device)` and DeepSpeed move them) and rebuild it from them with `with_tensors(**buffers)`; a module-wide
    dtype cast (`.to(dtype)`, `.bfloat16()`) would also cast the floating ones (FP8 codes, scales), so never cast."""

    row_align = 1  # dequantized row ranges start (and end, unless at `out`) on a multiple of this

    @property
    def shape(self) -> torch.Size:
        raise NotImplementedError

    def _dense(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop, dense in the format's natural dtype (the one the public dequant rounds to once)."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}

    def with_tensors(self, **tensors: torch.Tensor):
        """The same format (block size etc.) over other tensors: module buffers, moved or expert copies."""
        return dataclasses.replace(self, **tensors)

    def to(self, device):
        return self.with_tensors(**{name: t.to(device) for name, t in self.tensors().items()})

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def expert(self, e: int):
        """Expert e of a [E, out, in] weight: views of every stored tensor (E leads all of them)."""
        if len(self.shape) != 3:
            raise ValueError(f"expert() needs a 3D [E, out, in] weight, this one is {tuple(self.shape)}")
        return self.with_tensors(**{name: t[e] for name, t in self.tensors().items()})

    def dequantize(self, rows: slice | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense [..., rows, in] in `dtype`; rows must be contiguous and aligned to `row_align`."""
        out = self.shape[-2]
        start, stop, step = (rows or slice(None)).indices(out)
        if step != 1 or start % self.row_align or (stop % self.row_align and stop != out):
            raise ValueError(f"rows {start}:{stop}:{step} of {type(self).__name__} must be contiguous and aligned "
                             f"to {self.row_align} rows (or end at out={out})")
        return self._dense(start, max(start, stop)).to(dtype)
