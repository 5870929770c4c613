"""Which quantized checkpoint formats moetune reads, from config.json's `quantization_config` alone (torch-free:
the control plane refuses an unsupported one at submission; the workers' loader reads the same facts).

- "fp8": FP8 e4m3 with per-block `weight_scale_inv` (DeepSeek-V3/V3.2, Kimi-K2, Qwen3-FP8);
- "compressed-tensors", format "pack-quantized", 4-bit int weights in groups (Kimi K2 Thinking / K2.5);
- "mxfp4": e2m1 codes in groups of 32 with e8m0 scales (gpt-oss's routed experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.api.models import SpecError

FP8, INT4, MXFP4 = "fp8-block", "int4-pack-quantized", "mxfp4"


@dataclass(frozen=True)
class Quantization:
    format: str  # FP8 | INT4 | MXFP4
    block: tuple[int, int] | None = None  # FP8: weight_block_size
    group_size: int | None = None  # INT4: input channels per scale
    symmetric: bool = True  # INT4: no zero point


def _refuse(message: str) -> SpecError:
    return SpecError("model", f"model: {message}")


def _int4(qc: dict) -> Quantization:
    if qc.get("format") != "pack-quantized":
        raise _refuse(f"compressed-tensors format {qc.get('format')!r} is not supported (only 'pack-quantized')")
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if not weights or any(w.get("num_bits") != 4 or w.get("type") != "int" or w.get("strategy") != "group"
                          for w in weights) or len({(w.get("group_size"), w.get("symmetric")) for w in weights}) != 1:
        raise _refuse("compressed-tensors weights must be one 4-bit int group scheme (num_bits 4, type int, "
                      "strategy group)")
    if any(g.get("input_activations") for g in groups):
        raise _refuse("compressed-tensors activation quantization is not supported (frozen weights only)")
    return Quantization(INT4, group_size=weights[0]["group_size"], symmetric=bool(weights[0].get("symmetric", True)))


def quantization_of(config: dict) -> Quantization | None:
    """The checkpoint's quantized format, None for an unquantized one; a SpecError (param `model`) for one
    moetune does not read."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    qc = config.get("quantization_config") or text.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if qc.get("fmt", "e4m3") != "e4m3" or not (isinstance(block, list) and len(block) == 2):
            raise _refuse("FP8 checkpoints must be e4m3 with a weight_block_size [rows, cols] (block scales)")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise _refuse("FP8 static activation scales are not supported (frozen weights only)")
        return Quantization(FP8, block=(int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        return _int4(qc)
    if method == "mxfp4":
        return Quantization(MXFP4, group_size=32)
    raise _refuse(f"quantization_config.quant_method {method!r} is not supported; supported: fp8 (block scales), "
                  "compressed-tensors (pack-quantized INT4), mxfp4")
