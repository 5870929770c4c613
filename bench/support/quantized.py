"""Tiny quantized checkpoints in the public formats, made by quantizing a random transformers model and rewriting
its saved shards (DeepSeek's per-expert naming, as `save_pretrained` writes it):

- FP8 block (DeepSeek-V3 / V3.2 / Kimi-K2): every linear weight but lm_head becomes float8_e4m3fn +
  `weight_scale_inv` (router, norms, embeddings and V3.2's indexer head weights stay as they are);
  quantization_config {"quant_method": "fp8", ...};
- INT4 pack-quantized (Kimi K2 Thinking): only the routed experts become `weight_packed` / `weight_scale` /
  `weight_shape`, with compressed-tensors' quantization_config (attention, dense MLP, shared experts stay dense);
- MXFP4 (gpt-oss, from a gpt_oss model): the fused experts' `gate_up_proj` / `down_proj` ([E, in, out]) become
  `<proj>_blocks` [E, out, in/32, 16] and `<proj>_scales` [E, out, in/32] (uint8); their biases, attention, router,
  embeddings stay bf16, as in the released checkpoints.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file, save_file

from moetune.kernels.quant import quantize_fp8_block, quantize_int4, quantize_mxfp4

FP8_BLOCK = (8, 8)  # divides every dimension of the tiny models (transformers' CPU dequant needs that)
INT4_GROUP = 32
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# DeepSeek-V3.2 keeps its indexer's head weights in full precision (transformers: _keep_in_fp32_modules)
_NOT_FP8 = ("lm_head.weight", "embed_tokens.weight", "mlp.gate.weight", "indexer.weights_proj.weight")


def _fp8(name: str, tensor: torch.Tensor, block: tuple[int, int]) -> dict:
    if tensor.dim() != 2 or not name.endswith("proj.weight") or name.endswith(_NOT_FP8):
        return {name: tensor}
    q = quantize_fp8_block(tensor, block)
    return {name: q.weight, f"{name}_scale_inv": q.weight_scale_inv}


def _int4(name: str, tensor: torch.Tensor, block=None) -> dict:
    if not _ROUTED_EXPERT.search(name):
        return {name: tensor}
    q = quantize_int4(tensor.to(torch.bfloat16), INT4_GROUP)
    return {f"{name}_packed": q.weight_packed, f"{name}_scale": q.weight_scale,
            f"{name}_shape": torch.tensor(list(tensor.shape), dtype=torch.int64)}


def _mxfp4(name: str, tensor: torch.Tensor, block=None) -> dict:
    if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return {name: tensor.to(torch.bfloat16)}
    q = quantize_mxfp4(tensor.transpose(1, 2))  # stored [E, out, in]: rows are output features
    return {f"{name}_blocks": q.blocks, f"{name}_scales": q.scales}


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": INT4_GROUP, "dynamic": False, "actorder": None,
                                              "block_structure": None, "observer": "minmax",
                                              "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
FORMATS = {"fp8": (_fp8, FP8_CONFIG), "int4": (_int4, INT4_CONFIG), "mxfp4": (_mxfp4, MXFP4_CONFIG)}
# the family each format's test checkpoint is made from (gpt-oss is the MXFP4 family)
FAMILY_OF = {"fp8": "deepseek_v3", "int4": "deepseek_v3", "mxfp4": "gpt_oss"}


def quantize_checkpoint(dense_dir: str, out_dir: str, fmt: str, fp8_block: tuple[int, int] = FP8_BLOCK) -> str:
    """Rewrites the dense checkpoint at `dense_dir` (save_pretrained output) as an `fmt` one in `out_dir`."""
    quantize, config_entry = FORMATS[fmt]
    if fmt == "fp8":
        config_entry = {**config_entry, "weight_block_size": list(fp8_block)}
    os.makedirs(out_dir, exist_ok=True)
    index_path = os.path.join(dense_dir, "model.safetensors.index.json")
    shards = sorted(set(json.load(open(index_path))["weight_map"].values())) if os.path.exists(index_path) \
        else ["model.safetensors"]
    weight_map = {}
    for shard in shards:
        tensors = {}
        for name, tensor in load_file(os.path.join(dense_dir, shard)).items():
            tensors.update(quantize(name, tensor, fp8_block))
        save_file(tensors, os.path.join(out_dir, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    for name in os.listdir(dense_dir):  # config, tokenizer, generation config
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            with open(os.path.join(dense_dir, name), "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())
    config_path = os.path.join(out_dir, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"] = config_entry
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def dequantized_reference(fmt: str, path: str, dtype=torch.float32):
    """transformers' own dequantization of the `fmt` checkpoint at `path` (FP8: FineGrainedFP8; INT4:
    compressed-tensors; MXFP4: its Mxfp4 integration), in eval mode."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config, Mxfp4Config

    config = {"fp8": FineGrainedFP8Config, "int4": CompressedTensorsConfig, "mxfp4": Mxfp4Config}[fmt](dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=dtype).eval()
