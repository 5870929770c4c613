"""A frozen nn.Linear whose weight stays quantized (FP8 / INT4 / MXFP4): on CUDA, for the formats its kernel reads,
this package's Triton grouped GEMM with one expert, which dequantizes each [BLOCK_K, BLOCK_N] tile in registers and
accumulates in fp32 across the whole K, forward and dX alike; elsewhere (and asymmetric INT4) kernels.quant's tiled
PyTorch path. Here, above kernels.quant, because it runs this package's kernel."""

from __future__ import annotations

import torch
from torch import nn

from moetune.kernels.moe.function import moe_lora_linear
from moetune.kernels.quant import QuantizedWeight, held, hold
from moetune.kernels.quant import quantized_linear as tiled_quantized_linear


def _kernel_reads(qweight: QuantizedWeight) -> bool:
    return getattr(qweight, "weight_zero_point", None) is None  # the kernel reads symmetric INT4 only


def triton_quantized_linear(x: torch.Tensor, qweight: QuantizedWeight) -> torch.Tensor:
    """x [..., in] @ W^T for a 2D [out, in] qweight through the grouped kernel over one expert."""
    rows = x.reshape(-1, x.shape[-1])
    one_expert = qweight.with_tensors(**{name: t.unsqueeze(0) for name, t in qweight.tensors().items()})
    count = torch.full((1,), rows.shape[0], device=x.device)  # made on the device: no host sync
    y = moe_lora_linear(rows, count, one_expert, None, None, 0.0, backend="triton")
    return y.reshape(*x.shape[:-1], y.shape[-1])


def quantized_linear(x: torch.Tensor, qweight: QuantizedWeight) -> torch.Tensor:
    """The frozen quantized linear's product: Triton on CUDA where its kernel reads the format, else tiles."""
    if x.is_cuda and _kernel_reads(qweight):
        return triton_quantized_linear(x, qweight)
    return tiled_quantized_linear(x, qweight)


class QuantizedLinear(nn.Linear):
    """A frozen nn.Linear whose weight stays quantized: y = x Wᵀ + b with W dequantized a tile of rows at a time
    (quantized_linear above). PEFT wraps it like any nn.Linear; its LoRA stays in full precision."""

    def __init__(self, qweight: QuantizedWeight, bias: nn.Parameter | None):
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a dense weight
        self.out_features, self.in_features = qweight.shape
        self.register_parameter("weight", None)
        self.bias = bias
        hold(self, "weight", qweight)

    @property
    def qweight(self) -> torch.Tensor:
        """The stored codes, as bytes: where PEFT (like for GPTQ layers) reads a quantized layer's device, and why
        it leaves the LoRA dtype alone (not a floating tensor)."""
        return next(buffer for name, buffer in self.named_buffers(recurse=False) if name.startswith("weight_q_"))

    def forward(self, x):
        y = quantized_linear(x, held(self, "weight"))
        return y if self.bias is None else y + self.bias
