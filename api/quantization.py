"""Which quantized checkpoint formats moetune reads, from config.json's `quantization_config` alone (torch-free:
the control plane refuses an unsupported one at submission; the workers' loader reads the same facts).

- "fp8": FP8 e4m3 with per-block `weight_scale_inv` (DeepSeek-V3/V3.2, Kimi-K2, Qwen3-FP8);
- "compressed-tensors", format "pack-quantized", 4-bit int weights in groups (Kimi K2 Thinking / K2.5);
- "compressed-tensors", format "mxfp4-pack-quantized": MXFP4 stored per weight as `weight_packed` (two e2m1 codes a
  byte) + `weight_scale` (e8m0, one per 32) (Kimi K3's routed experts, per expert);
- "mxfp4": e2m1 codes in groups of 32 with e8m0 scales (gpt-oss's routed experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.api.config_fields import checked, config_error, read, read_positive_ints
from moetune.api.models.base import SpecError

FP8, INT4, MXFP4, MXFP4_PACKED = "fp8-block", "int4-pack-quantized", "mxfp4", "mxfp4-pack-quantized"
_SUPPORTED = "fp8 (block scales), compressed-tensors (pack-quantized INT4, mxfp4-pack-quantized), mxfp4"
_CT_FORMATS = ("pack-quantized", "mxfp4-pack-quantized")


@dataclass(frozen=True)
class Quantization:
    format: str  # FP8 | INT4 | MXFP4 | MXFP4_PACKED
    block: tuple[int, int] | None = None  # FP8: weight_block_size
    group_size: int | None = None  # INT4: input channels per scale
    symmetric: bool = True  # INT4: no zero point


def _refuse(message: str) -> SpecError:
    return SpecError("model", f"model: {message}")


def _compressed_tensors(qc: dict, where: str) -> Quantization:
    fmt = read(qc, "format", str, where)
    if fmt not in _CT_FORMATS:
        raise _refuse(f"compressed-tensors format {fmt!r} is not supported (only "
                      f"{' and '.join(map(repr, _CT_FORMATS))})")
    groups, schemes = read(qc, "config_groups", dict, where) or {}, []
    kind = "float" if fmt == "mxfp4-pack-quantized" else "int"
    for name, group in groups.items():
        field = f"{where}.config_groups.{name}"
        if read(checked(group, dict, field) or {}, "input_activations", dict, field):
            raise _refuse("compressed-tensors activation quantization is not supported (frozen weights only)")
        weights = read(group or {}, "weights", dict, field) or {}
        schemes.append((weights.get("num_bits") == 4 and weights.get("type") == kind
                        and weights.get("strategy") == "group", read(weights, "group_size", int, f"{field}.weights"),
                        read(weights, "symmetric", bool, f"{field}.weights")))
    if fmt == "mxfp4-pack-quantized":
        if not schemes or any(s != (True, 32, True) for s in schemes):
            raise _refuse("compressed-tensors mxfp4-pack-quantized weights must be one symmetric 4-bit float group "
                          "scheme of group_size 32 (num_bits 4, type float, strategy group)")
        return Quantization(MXFP4_PACKED, group_size=32)
    if not schemes or not all(ok and size for ok, size, _ in schemes) or len(set(schemes)) != 1:
        raise _refuse("compressed-tensors weights must be one 4-bit int group scheme (num_bits 4, type int, "
                      "strategy group, a group_size)")
    _, group_size, symmetric = schemes[0]
    return Quantization(INT4, group_size=group_size, symmetric=symmetric is not False)


def _fp8(qc: dict, where: str) -> Quantization:
    block = read_positive_ints(qc, "weight_block_size", where, length=2)
    if (read(qc, "fmt", str, where) or "e4m3") != "e4m3" or block is None:
        raise _refuse("FP8 checkpoints must be e4m3 with a weight_block_size [rows, cols] (block scales)")
    if (read(qc, "activation_scheme", str, where) or "dynamic") != "dynamic":
        raise _refuse("FP8 static activation scales are not supported (frozen weights only)")
    return Quantization(FP8, block=(block[0], block[1]))


def quantization_of(config: dict) -> Quantization | None:
    """The checkpoint's quantized format, None for an unquantized one; a SpecError (param `model`) for one
    moetune does not read, or a malformed quantization_config (naming its field)."""
    text = read(config, "text_config", dict) or {}
    where = "quantization_config" if config.get("quantization_config") else "text_config.quantization_config"
    qc = read(config, "quantization_config", dict) or read(text, "quantization_config", dict, "text_config")
    if not qc:
        return None
    method = read(qc, "quant_method", str, where)
    if method is None:
        raise config_error(f"{where}.quant_method", f"is missing; supported: {_SUPPORTED}")
    if method == "fp8":
        return _fp8(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "mxfp4":
        return Quantization(MXFP4, group_size=32)
    raise _refuse(f"{where}.quant_method {method!r} is not supported; supported: {_SUPPORTED}")
