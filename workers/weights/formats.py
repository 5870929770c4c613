"""How a quantized checkpoint names the parts of one frozen weight, and how the loaded parts become a
`kernels.quant` QuantizedWeight (the format itself is read from config.json: moetune.api.quantization).

A quantized model parameter `P` (a linear's `....weight`, or a fused expert tensor) is stored as parts: FP8 keeps
`P` itself (e4m3 codes) plus `P_scale_inv`; INT4 pack-quantized stores `P_packed`, `P_scale` (and, asymmetric,
`P_zero_point`) plus `P_shape`, a metadata vector the logical shape already implies; MXFP4 (gpt-oss experts)
stores `P_blocks` and `P_scales`; compressed-tensors' mxfp4-pack-quantized (Kimi K3's experts, one `P` per expert)
stores `P_packed` ([out, in/2] bytes) and `P_scale` ([out, in/32] e8m0). Each part is planned like any
checkpoint tensor (the same name mapping, expert slicing and concatenation as `P`), into a storage tensor named
`P:<part>` that keeps the checkpoint's dtype; nothing dense is ever allocated for `P`.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.api.quantization import FP8, INT4, MXFP4, MXFP4_PACKED, Quantization
from moetune.kernels.quant import Fp8BlockWeight, Int4PackedWeight, Mxfp4Weight, QuantizedWeight

PART_SEPARATOR = ":"
# Tensor-name endings that only quantized checkpoints have: met outside a format, they are never ignored silently.
QUANTIZED_SUFFIXES = ("_scale_inv", "weight_scale", "weight_packed", "weight_zero_point", "weight_shape",
                      "_blocks", "_scales")
_FP8_CODES = ("F8_E4M3",)


@dataclass(frozen=True)
class Part:
    param_key: str  # the checkpoint name the unquantized weight would have
    part: str | None  # the QuantizedWeight field it fills; None for metadata read nowhere (INT4 weight_shape)


def split(quantization: Quantization, key: str, dtype: str) -> Part | None:
    """The quantized weight a checkpoint tensor is a part of, or None for an ordinary tensor."""
    if quantization.format == FP8:
        if key.endswith("_scale_inv"):
            return Part(key.removesuffix("_scale_inv"), "weight_scale_inv")
        return Part(key, "weight") if dtype in _FP8_CODES else None
    if quantization.format in (INT4, MXFP4_PACKED):
        int4 = (("_zero_point", "weight_zero_point"), ("_shape", None)) if quantization.format == INT4 else ()
        for suffix, part in (("_packed", "weight_packed"), ("_scale", "weight_scale"), *int4):
            if key.endswith(".weight" + suffix):
                return Part(key.removesuffix(suffix), part)
    if quantization.format == MXFP4:
        for suffix in ("_blocks", "_scales"):
            if key.endswith(suffix):
                return Part(key.removesuffix(suffix), suffix[1:])
    return None


def weight_of(key: str) -> str:
    """The weight a checkpoint tensor belongs to, whatever the format: `X.weight` for `X.weight_scale_inv`,
    `X.weight_packed`, ...; the key itself for an ordinary tensor."""
    for suffix in QUANTIZED_SUFFIXES:
        if key.endswith(suffix):
            return key.removesuffix(suffix.removeprefix("weight"))  # "X.weight_packed" -> "X.weight"
    return key


def storage_name(param: str, part: str) -> str:
    return f"{param}{PART_SEPARATOR}{part}"


def parse_storage_name(name: str) -> tuple[str, str] | None:
    param, sep, part = name.rpartition(PART_SEPARATOR)
    return (param, part) if sep else None


def build(quantization: Quantization, parts: dict) -> QuantizedWeight:
    """The QuantizedWeight of one parameter from its loaded parts (a ValueError names what does not fit)."""
    if quantization.format == FP8:
        return Fp8BlockWeight(parts["weight"], parts["weight_scale_inv"], quantization.block)
    if quantization.format == MXFP4:
        return Mxfp4Weight(parts["blocks"], parts["scales"])
    if quantization.format == MXFP4_PACKED:  # a row's in/2 bytes are its groups of 16
        return Mxfp4Weight(parts["weight_packed"].unflatten(-1, (-1, 16)), parts["weight_scale"])
    return Int4PackedWeight(parts["weight_packed"], parts["weight_scale"], parts.get("weight_zero_point"))


def required_parts(quantization: Quantization) -> set[str]:
    if quantization.format == FP8:
        return {"weight", "weight_scale_inv"}
    if quantization.format == MXFP4:
        return {"blocks", "scales"}
    if quantization.format == MXFP4_PACKED:
        return {"weight_packed", "weight_scale"}
    return {"weight_packed", "weight_scale"} | (set() if quantization.symmetric else {"weight_zero_point"})
