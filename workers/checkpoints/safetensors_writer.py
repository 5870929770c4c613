"""A safetensors file written piecewise: the header (every tensor's name, dtype and shape) first, then each tensor's
bytes at their offsets, in any order and any number of pieces, so that no tensor has to be whole in memory."""

from __future__ import annotations

import json
import os

import torch

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class SafetensorsWriter:
    def __init__(self, path: str, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        self.starts, self.dtypes = {}, {}
        for name, (dtype, shape) in entries.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.starts[name], self.dtypes[name] = offset, dtype
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self.data_start = 8 + len(raw)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, len(raw).to_bytes(8, "little") + raw, 0)
        os.ftruncate(self.fd, self.data_start + offset)

    def write(self, name: str, element_offset: int, values: torch.Tensor) -> None:
        """`values` (any shape, flattened in C order) go to tensor `name` from its element `element_offset` on."""
        data = values.detach().to("cpu", self.dtypes[name]).contiguous().view(torch.uint8).numpy().tobytes()
        os.pwrite(self.fd, data, self.data_start + self.starts[name] + element_offset * self.dtypes[name].itemsize)

    def close(self) -> None:
        os.close(self.fd)
