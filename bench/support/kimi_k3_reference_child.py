"""Runs in a child process with NeMo Automodel 0.7.0 and fla 0.6.0 on its path (bench/support/kimi_k3_reference.py):
the reference Kimi K3 text model writes tiny checkpoints in the release's naming (its own state-dict adapter; routed
experts MXFP4-packed by compressed-tensors' own compressor) and computes logits, first loss and LoRA gradients on
each, in fp32. fla's CUDA-only ops are replaced by fla's own pure-torch references (naive_recurrent_kda,
naive_kda_lowerbound_gate, naive_attnres) and torch versions of ShortConvolution and FusedRMSNormGated.

With "decode" in the request it also decodes greedily on the MXFP4 checkpoint, the base and with an adapter (its
linear LoRA the LoRA above, its expert LoRA the deltas the request names, merged into the dequantized experts), by
full recomputation each step (the reference runs without a cache).

With "vision" in the request it also builds the reference's multimodal model (MoonViT3d tower + patchmergerv2
projector) over the same text config, writes it in the released naming (vision/, bf16) and computes, in fp32, the
projected image features and the logits of rows whose images are given one placeholder token each (the reference
expands them itself), on the pixels the request's vision_inputs.pt holds.

With "step_repeats" in the request (bench/k3_step.py) it times its LoRA train step on the bf16 checkpoint instead.

usage: python kimi_k3_reference_child.py WORKDIR   (WORKDIR/request.json in; checkpoints and reference.pt or
step.json out)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's in-kernel q/k normalisation (fla.modules.norm.l2norm: x / sqrt(sum x^2 + eps))."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _swap_fla_ops():
    """Every fla op the reference calls on CPU becomes a pure-torch one (fla's own naive references where it has
    them); nothing else of the reference changes."""
    from fla.modules import FusedRMSNormGated, ShortConvolution
    from fla.ops.attnres.naive import naive_attnres
    from fla.ops.kda.gate import naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda
    from nemo_automodel.components.models.kimi_k3 import model as k3
    from nemo_automodel.components.models.kimi_k3 import vision as k3vision

    def kda(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
            use_qk_l2norm_in_kernel=False, **_):
        assert cu_seqlens is None and initial_state is None
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q).to(q.dtype), _l2norm(k).to(k.dtype)
        return naive_recurrent_kda(q, k, v, g, beta, output_final_state=output_final_state)

    def gate(g, a_log, head_dim, dt_bias, lower_bound):
        assert lower_bound is not None, "K3's gate is the lower-bounded one"
        g = g.reshape(*g.shape[:-1], -1, head_dim)
        return naive_kda_lowerbound_gate(g, a_log, dt_bias, lower_bound=lower_bound)

    def attn_res(prefix_sum, block_residual, projection, norm):
        sources = [*block_residual.unbind(1), prefix_sum]
        return naive_attnres(projection.weight, sources, norm.weight, rms_eps=norm.variance_epsilon)

    def short_conv(self, x, cache=None, output_final_state=False, cu_seqlens=None, **_):
        assert cu_seqlens is None and cache is None
        width = self.kernel_size[0]
        y = F.conv1d(x.transpose(1, 2).to(self.weight.dtype), self.weight, self.bias, padding=width - 1,
                     groups=self.hidden_size)[..., : x.shape[1]]
        return F.silu(y).transpose(1, 2).to(x.dtype), None

    def norm_gated(self, x, g, **_):
        assert self.activation == "sigmoid"
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * torch.sigmoid(g.float())).to(x.dtype)

    def rope_shape(org, interpolation_mode, shape):  # vision.get_rope_shape's math, without its torch.compile
        table = F.interpolate(org.permute((2, 0, 1)).unsqueeze(0), size=shape, mode=interpolation_mode)
        return table.squeeze(0).permute((1, 2, 0)).flatten(end_dim=1)

    k3vision.get_rope_shape = rope_shape
    k3.chunk_kda = k3.fused_recurrent_kda = kda
    k3._fused_kda_gate = gate
    k3._apply_attn_res = attn_res
    ShortConvolution.forward = short_conv
    FusedRMSNormGated.forward = norm_gated


def _backend():
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn="eager", linear="torch", rms_norm="torch", experts="torch", dispatcher="torch",
                         enable_hf_state_dict_adapter=True)


def _reference_model(text_config: dict):
    from nemo_automodel.components.models.kimi_k3.config import KimiK3TextConfig
    from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM

    return KimiK3ForCausalLM(KimiK3TextConfig(**text_config), backend=_backend())


def _vision_reference(text: dict, config: dict, request: dict, workdir: str) -> dict:
    """The multimodal reference: its checkpoint in vision/, and on vision_inputs.pt ({"input_ids" with one
    placeholder per image, "pixel_values", "grid_thws"}) its projected features, tokens per image and logits."""
    from nemo_automodel.components.models.kimi_k3.config import KimiK3Config
    from nemo_automodel.components.models.kimi_k3.multimodal import KimiK3ForConditionalGeneration
    from nemo_automodel.components.models.kimi_k3.vision import get_1d_sincos_pos_embed

    vision = request["vision"]
    placeholder = vision["placeholder_token_id"]
    model = KimiK3ForConditionalGeneration(
        KimiK3Config(text_config=dict(text), vision_config={**vision["vision_config"], "attn_implementation": "eager"},
                     media_placeholder_token_id=placeholder), backend=_backend())
    _randomise(model, request["seed"] + 7)
    hf = {k: v.detach().clone() for k, v in model.state_dict_adapter.to_hf(model.state_dict()).items()}
    _write(os.path.join(workdir, "vision"), {**config, "vision_config": vision["vision_config"],
                                             "media_placeholder_token_id": placeholder}, hf)
    model.float()
    # its bf16 cast also rounded the tower's non-persistent sin-cos time table: rebuilt in fp32, as constructed
    pos_emb = model.vision_tower.patch_embed.pos_emb
    pos_emb.time_weight = torch.from_numpy(get_1d_sincos_pos_embed(pos_emb.dim, pos_emb.num_frames)).float()[:, None]
    inputs = torch.load(os.path.join(workdir, "vision_inputs.pt"))
    with torch.no_grad():
        features = model._extract_image_features(inputs["pixel_values"], inputs["grid_thws"])
        logits = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                       grid_thws=inputs["grid_thws"]).logits
    return {"features": torch.cat(features), "tokens_per_image": [len(f) for f in features], "logits": logits}


def _randomise(model, seed: int) -> None:
    """The reference's own initialisation, then norms, gate biases and the router's correction bias moved off
    their constant starts, so that a swapped or skipped one shows."""
    torch.manual_seed(seed)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "dt_bias" in name or "e_score_correction_bias" in name:
                tensor.add_(0.1 * torch.randn_like(tensor.float()).to(tensor.dtype))


def _mxfp4_pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own MXFP4 compressor (format mxfp4-pack-quantized) on one [out, in] expert weight."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    amax = weight.float().unflatten(-1, (-1, 32)).abs().amax(-1)
    scale = torch.exp2(generate_mx_scales(amax) - 127)
    packed = MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    return {"weight_packed": packed["weight_packed"], "weight_scale": packed["weight_scale"]}


def _mxfp4_checkpoint(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Routed experts packed, everything else as it is; each packed expert decodes to the same bf16 weight by the
    reference's dequantize_mxfp4 as by compressed-tensors' own decompression (the two agree on nibble order)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    from nemo_automodel.components.models.kimi_k3.state_dict_adapter import dequantize_mxfp4

    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    out = {}
    for key, value in hf.items():
        if ".block_sparse_moe.experts." not in key:
            out[key] = value
            continue
        stem = key.removesuffix(".weight")
        packed = _mxfp4_pack(value)
        ours = dequantize_mxfp4(packed["weight_packed"], packed["weight_scale"], torch.float32)
        theirs = MXFP4PackedCompressor.decompress(dict(packed), scheme)["weight"].float()
        assert torch.equal(ours, theirs), key
        out[f"{stem}.weight_packed"], out[f"{stem}.weight_scale"] = packed["weight_packed"], packed["weight_scale"]
    return out


def _quantization_config(ignore: list[str]) -> dict:
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}}},
            "ignore": ignore}


def _write(folder: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})


def _released_name(adapter, native: str) -> str:
    """A reference module/parameter name as the release (and moetune's model) names it."""
    from nemo_automodel.components.models.kimi_k3.state_dict_adapter import _native_moe_key_to_hf

    return adapter._add_hf_text_prefix(_native_moe_key_to_hf(native))


def _with_lora(model, hf: dict, request: dict, weights: dict | None = None):
    """`model` loaded with one checkpoint the reference's way, fp32, under LoRA on every linear both models have:
    `weights` (by PEFT name), else random ones."""
    from peft import LoraConfig, get_peft_model

    native = model.state_dict_adapter.from_hf(dict(hf))
    model.float()  # before loading: fp32 tensors (merged expert LoRA) load unrounded
    missing, unexpected = model.load_state_dict(native, strict=False)
    assert not unexpected and not [m for m in missing if "lora" not in m], (missing, unexpected)
    torch.manual_seed(request["seed"] + 1)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=request["lora_targets"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn_like(p) if weights is None else weights[name])
    return lora


def _run(model, adapter, hf: dict, request: dict) -> dict:
    """Logits, loss and the LoRA gradients (by released name) of one checkpoint under random LoRA; "peft_weights"
    keeps that LoRA by PEFT name."""
    lora = _with_lora(model, hf, request)
    peft_weights = {n: p.detach().clone() for n, p in lora.named_parameters() if "lora_" in n}
    lora_weights = {_released_name(adapter, n.removeprefix("base_model.model.")): p
                    for n, p in peft_weights.items()}
    ids = torch.tensor(request["input_ids"])
    out = lora.base_model.model(ids)
    logits = out.logits.float()
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {_released_name(adapter, n.removeprefix("base_model.model.")): p.grad.detach().clone()
             for n, p in lora.named_parameters() if "lora_" in n}
    return {"logits": logits.detach(), "loss": loss.detach(), "lora_weights": lora_weights, "lora_grads": grads,
            "peft_weights": peft_weights}


def _greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            answers.append(ids[len(prompt):])
    return answers


def _greedy_decodes(text: dict, packed: dict, peft_weights: dict, request: dict, workdir: str) -> dict:
    """{"base", "adapter": one answer per prompt} on the MXFP4 checkpoint; the adapter's expert LoRA is merged:
    each released expert weight, dequantized by the reference's own code, plus its delta."""
    from nemo_automodel.components.models.kimi_k3.state_dict_adapter import dequantize_mxfp4

    decode = request["decode"]
    prompts, new_tokens = decode["prompts"], decode["new_tokens"]
    lora = _with_lora(_reference_model(text), packed, request, peft_weights)
    with lora.disable_adapter():
        base = _greedy(lora.base_model.model, prompts, new_tokens)
    deltas = torch.load(os.path.join(workdir, decode["expert_deltas"]))
    merged = {k: v for k, v in packed.items() if ".block_sparse_moe.experts." not in k}
    for key in [k for k in packed if k.endswith(".weight_packed")]:
        stem = key.removesuffix(".weight_packed")
        weight = dequantize_mxfp4(packed[key], packed[f"{stem}.weight_scale"], torch.float32)
        merged[f"{stem}.weight"] = weight + deltas.pop(f"{stem}.weight")
    assert not deltas, sorted(deltas)  # every delta names a released expert weight
    adapted = _with_lora(_reference_model(text), merged, request, peft_weights)
    return {"base": base, "adapter": _greedy(adapted.base_model.model, prompts, new_tokens)}


def _step_seconds(model, hf: dict, request: dict) -> dict:
    """The reference's LoRA train step in bf16 (forward, loss, backward, AdamW on the LoRA of every linear both
    models hold): median seconds of `step_repeats` steps after one warm-up, and its routed experts' bytes."""
    from peft import LoraConfig, get_peft_model

    adapter = model.state_dict_adapter
    missing, unexpected = model.load_state_dict(adapter.from_hf(dict(hf)), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    model.to(torch.bfloat16)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    torch.manual_seed(request["seed"] + 1)
    lora = get_peft_model(model, LoraConfig(r=request["lora_rank"], lora_alpha=2 * request["lora_rank"],
                                            target_modules=request["lora_targets"]))
    params = [p for p in lora.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.tensor(request["input_ids"])
    seconds = []
    for _ in range(1 + request["step_repeats"]):
        started = time.perf_counter()
        logits = lora.base_model.model(ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
    return {"step_seconds": statistics.median(seconds[1:]), "expert_bytes": expert_bytes}


def main(workdir: str) -> None:
    _swap_fla_ops()
    with open(os.path.join(workdir, "request.json")) as f:
        request = json.load(f)
    text = request["text_config"]
    model = _reference_model(text)
    _randomise(model, request["seed"])
    adapter = model.state_dict_adapter
    hf = {k: v.detach().clone() for k, v in adapter.to_hf(model.state_dict()).items()}
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
              "text_config": {**text, "model_type": "kimi_linear", "architectures": ["KimiK3ForCausalLM"]},
              "torch_dtype": "bfloat16"}
    packed = _mxfp4_checkpoint(hf)
    ignore = sorted({k.rsplit(".", 1)[0] for k in hf if ".block_sparse_moe.experts." not in k and
                     k.endswith(".weight") and "norm" not in k})
    _write(os.path.join(workdir, "bf16"), config, hf)
    _write(os.path.join(workdir, "mxfp4"), {**config, "quantization_config": _quantization_config(ignore)}, packed)
    if "step_repeats" in request:
        with open(os.path.join(workdir, "step.json"), "w") as f:
            json.dump(_step_seconds(_reference_model(text), hf, request), f)
        return
    results = {}
    for name, tensors in (("bf16", hf), ("mxfp4", packed)):
        fresh = _reference_model(text)
        results[name] = _run(fresh, fresh.state_dict_adapter, tensors, request)
    if "decode" in request:
        results["decode"] = _greedy_decodes(text, packed, results["mxfp4"]["peft_weights"], request, workdir)
    if "vision" in request:
        results["vision"] = _vision_reference(text, config, request, workdir)
    torch.save(results, os.path.join(workdir, "reference.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
