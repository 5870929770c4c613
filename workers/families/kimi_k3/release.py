"""A tiny K3 checkpoint in the release's own format, from the one transformers' `save_pretrained` writes of
moetune's model: config.json nests the language model in `text_config` with Kimi-Linear's model_type and no
derived `layer_types`; the routed experts are stored per expert (`experts.{E}.w1|w2|w3`) in compressed-tensors'
`mxfp4-pack-quantized` (`weight_packed` [out, in/2], two e2m1 codes a byte, low nibble first; `weight_scale`
[out, in/32], e8m0), everything else bf16. Packed by moetune's own MXFP4 quantizer (the demo writes it; the K3
tests write theirs with the reference's adapter)."""

from __future__ import annotations

import json
import os
import re

# the routed experts as the checkpoint conversion writes them: one 2-D weight per expert and projection
_PER_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def as_released(local_dir: str) -> None:
    """Rewrites the checkpoint in `local_dir` (shards, index, config.json) into the release's format, in place."""
    import torch
    from safetensors.torch import load_file, save_file

    from moetune.kernels.quant import quantize_mxfp4

    index_path = os.path.join(local_dir, "model.safetensors.index.json")
    index = json.load(open(index_path))
    weight_map, unquantized = {}, set()
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, tensor in load_file(os.path.join(local_dir, shard)).items():
            if _PER_EXPERT_WEIGHT.search(name):
                packed = quantize_mxfp4(tensor)
                tensors[f"{name}_packed"], tensors[f"{name}_scale"] = packed.blocks.flatten(-2), packed.scales
            else:
                tensors[name] = tensor.to(torch.bfloat16)
                if name.endswith(".weight") and "norm" not in name:
                    unquantized.add(name.removesuffix(".weight"))
        save_file(tensors, os.path.join(local_dir, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    with open(index_path, "w") as f:
        json.dump({**index, "weight_map": weight_map}, f, indent=2)
    config_path = os.path.join(local_dir, "config.json")
    config = json.load(open(config_path))
    text = {k: v for k, v in config["text_config"].items() if k not in ("layer_types", "dtype")}
    config.update(text_config={**text, "model_type": "kimi_linear", "architectures": ["KimiK3ForCausalLM"]},
                  dtype="bfloat16", quantization_config=_mxfp4_pack_quantization(sorted(unquantized)))
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def _mxfp4_pack_quantization(ignore: list[str]) -> dict:
    """compressed-tensors' quantization_config of weight-only MXFP4 (group 32, e8m0 scales) on every Linear but
    the modules in `ignore`."""
    weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
               "dynamic": False, "scale_dtype": "torch.uint8"}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ignore}
