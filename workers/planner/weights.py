"""The frozen base weights of a model built on the meta device, tensor by tensor: routed expert or not, the decoder
layer it sits in, and the bytes one copy takes on the device, quantized weights at their stored size.

Which weights a quantized checkpoint stores quantized is the loader's business (it reads the shards); from
config.json alone the planner takes the formats' usual scope: every linear weight but `lm_head`, the routers and
what the config's `ignore` / `modules_to_not_convert` names, plus the routed experts (FP8 block, INT4); the routed
experts only (MXFP4, gpt-oss's format).
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass

import torch

from moetune.api.quantization import FP8, INT4, MXFP4, Quantization, quantization_of
from moetune.workers.families.spec import Family
from moetune.workers.lora.coverage import ROUTER, modules
from moetune.workers.pipeline.stages import text_model
from moetune.workers.weights.quantized import quantized_shape

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Tensor:
    name: str
    nbytes: int  # one copy on the device (all experts of a fused expert tensor)
    label: str  # dtype, or the quantized format
    expert: bool  # a routed expert tensor: its first dimension is the expert
    layer: int | None  # the text model's decoder layer
    partitionable: bool  # a parameter ZeRO-3 partitions (quantized weights are held buffers, never partitioned)
    elements: int = 0  # the weights it stands for (a quantized one's unpacked), where a token's matmul reads them all
    first_stage: bool = False  # outside the decoder layers, on the first pipeline stage (the embeddings, a vision
    # tower); the rest outside them (final norm, output layer) on the last


def quantized_bytes(q: Quantization, out: int, inp: int) -> int:
    """Stored bytes of one [out, in] weight (kernels.quant's layouts)."""
    if q.format == FP8:
        b0, b1 = q.block
        return out * inp + math.ceil(out / b0) * math.ceil(inp / b1) * 4  # e4m3 codes, fp32 block scales
    if q.format == INT4:
        groups = math.ceil(inp / q.group_size)
        zero_points = 0 if q.symmetric else math.ceil(out / 8) * groups * 4
        return out * math.ceil(inp / 8) * 4 + out * groups * 2 + zero_points  # int32 words, bf16 scales
    return out * inp // 2 + out * math.ceil(inp / 32)  # MXFP4: two e2m1 codes a byte, one e8m0 scale per 32


def _not_converted(name: str, patterns: list[str]) -> bool:
    """compressed-tensors' `ignore` (`re:` regexes, or names) and transformers' `modules_to_not_convert`
    (substrings, `*` globs)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern in name or fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(name, f"*{pattern}*"):
            return True
    return False


def _quantization_config(config: dict) -> dict:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("quantization_config") or text.get("quantization_config") or {}


def frozen_tensors(model, family: Family, config: dict, dtype: torch.dtype, dequantized: bool) -> list[Tensor]:
    """Every parameter and buffer of the plain (meta) model. `dequantized`: training.base_weights says to expand
    a quantized base at load."""
    q = None if dequantized else quantization_of(config)
    qc = _quantization_config(config)
    skip = list(qc.get("ignore") or []) + list(qc.get("modules_to_not_convert") or [])
    routers = {m.name for m in modules(model, family) if m.kind == ROUTER}
    expert_modules = {f"{name}.{family.experts}" for name, _ in family.moe_blocks(model)}
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    text = text_model(model)
    text_at, layers_at, embeddings_at = (next(n for n, m in model.named_modules() if m is module)
                                         for module in (text, text.layers, model.get_input_embeddings()))
    found = []
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        match = _LAYER.search(f".{name}") if name.startswith(f"{layers_at}.") else None
        layer = int(match.group(1)) if match else None
        first = layer is None and (name.startswith(f"{embeddings_at}.") or
                                   not name.startswith((f"{text_at}.", f"{head}.")))
        expert = owner in expert_modules
        expert_weight = expert and not leaf.endswith("_bias")
        linear_weight = (owner in linears and leaf == "weight" and owner != head and owner not in routers
                         and not _not_converted(owner, skip))
        matmul = expert_weight or (owner in linears or owner in routers) and leaf == "weight"
        if q is not None and (expert_weight or linear_weight and q.format != MXFP4):
            shape = quantized_shape(model, name, tuple(tensor.shape))
            count = math.prod(shape[:-2])
            found.append(Tensor(name, count * quantized_bytes(q, shape[-2], shape[-1]), q.format, expert, layer,
                                False, math.prod(shape), first))
        else:
            stored = dtype if tensor.is_floating_point() and isinstance(tensor, torch.nn.Parameter) else tensor.dtype
            found.append(Tensor(name, tensor.numel() * stored.itemsize, str(stored).removeprefix("torch."), expert,
                                layer, isinstance(tensor, torch.nn.Parameter), tensor.numel() if matmul else 0,
                                first))
    return found
