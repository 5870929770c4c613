"""Frozen quantized base weights kept in their checkpoint form (FP8 block, INT4 pack-quantized, MXFP4) and the
linear that dequantizes them a tile of rows at a time, forward and backward, never the whole dense weight."""

from moetune.kernels.quant.fp8 import Fp8BlockWeight, quantize_fp8_block
from moetune.kernels.quant.int4 import Int4PackedWeight, quantize_int4
from moetune.kernels.quant.linear import quantized_linear
from moetune.kernels.quant.modules import held, held_names, hold
from moetune.kernels.quant.mxfp4 import Mxfp4Weight, quantize_mxfp4
from moetune.kernels.quant.weight import QuantizedWeight

__all__ = ["Fp8BlockWeight", "Int4PackedWeight", "Mxfp4Weight", "QuantizedWeight", "held",
           "held_names", "hold", "quantize_fp8_block", "quantize_int4", "quantize_mxfp4", "quantized_linear"]
