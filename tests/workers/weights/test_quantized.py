"""Quantized bases streamed and kept quantized: tiny FP8-block and INT4 pack-quantized (DeepSeek-V3) and MXFP4
(gpt-oss) checkpoints written in the public naming (tests/support/quantized.py) give the logits of transformers'
own dequantized model, the LoRA gradients of the same model dequantized, each EP rank reads and holds only its
quantized share, and anything the loader cannot read correctly is an error naming the tensor."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from moetune.api.families import FAMILIES
from moetune.api.models.lora import LoraSpec
from moetune.api.models.training import TrainingSpec
from moetune.workers.families import REGISTRY
from moetune.workers.model import trainable_model
from moetune.workers.experts.placement import placement_at
from moetune.workers.weights.errors import WeightsError
from moetune.workers.weights.loader import load_summary, stream_model
from bench.support.tiny_models import batch, plain_model
from bench.support.quantized import FAMILY_OF, dequantized_reference, quantize_checkpoint

CPU, F32 = torch.device("cpu"), torch.float32
FORMAT_NAMES = {"fp8": "fp8-block", "int4": "int4-pack-quantized", "mxfp4": "mxfp4"}
LORA = LoraSpec(rank=4, alpha=8, dropout=0.0, train_experts=True)


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random DeepSeek-V3 (the architecture of Kimi-K2) and gpt-oss models saved by transformers, routing
    spread out (gpt-oss: random expert biases too)."""
    out = {}
    for family in sorted(set(FAMILY_OF.values())):
        out[family] = str(tmp_path_factory.mktemp(f"dense-{family}"))
        plain_model(REGISTRY[family]).save_pretrained(out[family], max_shard_size="100KB")
    return out


@pytest.fixture(scope="module", params=["fp8", "int4", "mxfp4"])
def quantized(request, dense_dirs, tmp_path_factory) -> tuple[str, str]:
    fmt = request.param
    return fmt, quantize_checkpoint(dense_dirs[FAMILY_OF[fmt]], str(tmp_path_factory.mktemp(fmt)), fmt)


def _trainable(model):
    torch.manual_seed(1)
    return trainable_model(model, LORA, TrainingSpec(), placement_at(model.config.to_dict(), 1, 0))


def _forward_backward(model) -> tuple[torch.Tensor, dict]:
    inputs = batch(0, 0, vocab=272)
    out = model(**inputs)
    out.loss.backward()
    grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads


def test_logits_and_lora_gradients_match_the_dequantized_model(quantized):
    fmt, path = quantized
    streamed = stream_model(f"file://{path}", CPU, F32, cache_dir="")
    assert streamed.quantization == FORMAT_NAMES[fmt]
    kept = [m for m in streamed.model.modules() if type(m).__name__ == "QuantizedLinear"]
    assert bool(kept) == (fmt == "fp8")  # INT4 (Kimi K2 Thinking) and MXFP4 quantize only the routed experts
    reference = dequantized_reference(fmt, path)
    # transformers keeps the decompressed INT4 experts in bf16 (whatever dtype it is asked for): bf16 tolerance
    tolerance = {"rtol": 2e-2, "atol": 2e-3} if fmt == "int4" else {"rtol": 1e-4, "atol": 1e-5}
    quant_logits, quant_grads = _forward_backward(_trainable(streamed.model))
    with torch.no_grad():  # LoRA B = 0: the base model's logits
        torch.testing.assert_close(quant_logits, reference(**batch(0, 0, vocab=272)).logits, **tolerance)
    # LoRA (linears and routed experts) trains the same on the quantized base as on the dequantized one
    dense = stream_model(f"file://{path}", CPU, F32, cache_dir="", base_weights="dequantized")
    assert dense.quantized_bytes == 0
    assert not [m for m in dense.model.modules() if type(m).__name__ == "QuantizedLinear"]
    dense_logits, dense_grads = _forward_backward(_trainable(dense.model))
    torch.testing.assert_close(quant_logits, dense_logits, rtol=1e-4, atol=1e-5)
    assert quant_grads.keys() == dense_grads.keys() and any(".experts.lora_" in n for n in quant_grads)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(quant_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_dpo_on_the_quantized_base_trains_as_on_the_dequantized_one(quantized):
    """DPO's reference is the base with every LoRA off (workers.methods.dpo.lora_off), here LoRA on quantized
    linears (FP8) and packed routed experts: it gives the dequantized base's log-probabilities, and the DPO loss,
    rewards and LoRA gradients equal those on the dequantized model (LoRA B random: the policy is not the
    reference)."""
    from types import SimpleNamespace

    from moetune.workers.methods.dpo import DpoMethod, lora_off
    from tests.workers.methods.test_dpo import random_lora_b, random_pairs

    fmt, path = quantized
    runs = {}
    for weights in ("quantized", "dequantized"):
        streamed = stream_model(f"file://{path}", CPU, F32, cache_dir="", base_weights=weights)
        model = _trainable(streamed.model)
        random_lora_b(model)
        method = DpoMethod(SimpleNamespace(pad_token_id=0), seq_len=64, beta=0.5)
        method.prepare(model)
        pairs = method.collate(random_pairs(7))
        with torch.no_grad(), lora_off(model):
            reference = method.log_probs(model, pairs)
        loss = method.loss_sum(model, pairs)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        runs[weights] = reference, loss.detach(), method.figure_sums(), grads
        with torch.no_grad():  # every LoRA B zero: the base itself
            random_lora_b(model, scale=0.0)
            torch.testing.assert_close(reference, method.log_probs(model, pairs), rtol=1e-5, atol=1e-5)
    (reference, loss, figures, grads), (dense_reference, dense_loss, dense_figures, dense_grads) = runs.values()
    torch.testing.assert_close(reference, dense_reference, rtol=1e-4, atol=1e-5)
    assert abs(loss.item() / 2 - 0.6931) > 1e-3  # the policy moved away from the reference
    torch.testing.assert_close(loss, dense_loss, rtol=1e-4, atol=1e-6)
    assert figures == pytest.approx(dense_figures, rel=1e-4, abs=1e-6)
    assert grads.keys() == dense_grads.keys() and any(".experts.lora_" in n for n in grads)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_fp8_deepseek_v32_attends_over_the_latent_through_its_quantized_kv_b_proj(tmp_path):
    """An FP8 DeepSeek-V3.2 (its MLA and indexer projections quantized, as released) streamed and kept quantized,
    its DSA attention on the sparse kernel over the absorbed latent, kv_b_proj (and its LoRA) read through the FP8
    weight: transformers' dequantized model's logits, and the dequantized base's LoRA gradients."""
    from moetune.workers.families import apply_kernel_swaps, mla

    dense = str(tmp_path / "dense")
    plain_model(REGISTRY["deepseek_v32"]).save_pretrained(dense, max_shard_size="100KB")
    path = quantize_checkpoint(dense, str(tmp_path / "fp8"), "fp8")
    kv_heads, attend = [], mla.sparse_attention

    def counted(q, k, *args, **kwargs):
        kv_heads.append(k.shape[2])
        return attend(q, k, *args, **kwargs)

    runs = {}
    for weights in ("kept", "dequantized"):
        streamed = stream_model(f"file://{path}", CPU, F32, cache_dir="", base_weights=weights)
        apply_kernel_swaps(streamed.model)
        mla.sparse_attention = counted
        try:
            runs[weights] = _forward_backward(_trainable(streamed.model))
        finally:
            mla.sparse_attention = attend
        if weights == "kept":
            assert type(streamed.model.model.layers[0].self_attn.kv_b_proj.base_layer).__name__ == "QuantizedLinear"
    assert kv_heads == [1] * 6  # three DSA layers, twice: over the latent
    with torch.no_grad():
        torch.testing.assert_close(runs["kept"][0], dequantized_reference("fp8", path)(**batch(0, 0, vocab=272)).logits,
                                   rtol=1e-4, atol=1e-5)
    assert any(".kv_b_proj.lora_" in n for n in runs["kept"][1])
    for name, grad in runs["dequantized"][1].items():
        torch.testing.assert_close(runs["kept"][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _rank_share_bytes(path: str, rank: int, ep: int, num_experts: int) -> tuple[int, int]:
    """Bytes of the checkpoint tensors EP rank `rank` needs (all but the other ranks' routed experts: per-expert
    tensors, or rows of fused ones), and how many of them are INT4 `weight_shape` metadata (implied by the other
    tensors: never read)."""
    index = json.load(open(f"{path}/model.safetensors.index.json"))["weight_map"]
    total = metadata = 0
    for name, shard in index.items():
        with safe_open(f"{path}/{shard}", framework="pt") as f:
            tensor = f.get_slice(name)
            nbytes = math.prod(tensor.get_shape()) * {"F8_E4M3": 1, "I32": 4, "I64": 8, "BF16": 2, "F32": 4,
                                                       "U8": 1}[tensor.get_dtype()]
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            expert = int(parts[parts.index("experts") + 1])
            if expert // (num_experts // ep) != rank:
                continue
        elif "experts" in parts:  # fused [E, ...]
            nbytes //= ep
        total += nbytes
        metadata += nbytes if name.endswith("weight_shape") else 0
    return total, metadata


def test_each_ep_rank_reads_and_holds_only_its_quantized_share(quantized):
    fmt, path = quantized
    config = json.load(open(f"{path}/config.json"))
    dense_dtype = torch.bfloat16 if fmt == "mxfp4" else F32  # that of the checkpoint's dense tensors
    for rank in range(2):
        # merge_gap=0: the tiny tensors lie closer together than the default gap a real load reads through
        streamed = stream_model(f"file://{path}", CPU, dense_dtype, placement_at(config, 2, rank), cache_dir="",
                                merge_gap=0)
        share, shape_metadata = _rank_share_bytes(path, rank, 2, FAMILIES[config["model_type"]].num_experts(config))
        assert streamed.stats.bytes_needed == share - shape_metadata
        assert streamed.stats.bytes_from_storage <= 1.05 * share
        model = streamed.model
        persistent = model.state_dict(keep_vars=True)  # the checkpoint's buffers (router bias), not rotary tables
        dense = [p.nbytes for p in model.parameters()] + [b.nbytes for n, b in model.named_buffers() if n in persistent]
        frozen = streamed.quantized_bytes + sum(dense)
        assert frozen == share - shape_metadata, (frozen, share)
        message, data = load_summary(streamed, 2)
        assert f"{streamed.quantization} base" in message and data["quantized_bytes"] == streamed.quantized_bytes


def _rewrite(path, tmp_path, config_update=None, drop=(), truncate=()) -> str:
    """A copy of the checkpoint at `path` with config.json changed, some tensors left out and some cut short (by
    their last row)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "changed"
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in (config_update or {}).items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        tensors = load_file(str(out / shard))
        save_file({k: v[:-1] if truncate and k.endswith(truncate) else v for k, v in tensors.items()
                   if not k.endswith(drop) or not drop}, str(out / shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not drop or not k.endswith(drop)}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return f"file://{out}"


def _refused_by_the_loader_and_inspect(uri: str, match: str) -> None:
    """`models inspect` (at EP=4: expert 3 is rank 1's second) refuses what the loader refuses, with its words."""
    from moetune.workers.weights.push import inspect

    with pytest.raises(WeightsError, match=match):
        stream_model(uri, CPU, F32, cache_dir="")
    with pytest.raises(WeightsError, match=match):
        inspect(uri, ep=4)


def test_what_cannot_load_correctly_is_an_error_naming_the_tensor(quantized, tmp_path):
    fmt, path = quantized
    _refused_by_the_loader_and_inspect(_rewrite(path, tmp_path / "a", {"quantization_config": {"quant_method": "awq"}}),
                                       "quant_method 'awq' is not supported")
    no_config = _rewrite(path, tmp_path / "b", {"quantization_config": None})
    unread = "quantization tensors that no weight of this model reads .*config.json has no quantization_config"
    expected = {"fp8": "is F8_E4M3 but config.json has no quantization_config", "int4": f"{unread}.*weight_packed",
                "mxfp4": f"{unread}.*_blocks"}[fmt]
    _refused_by_the_loader_and_inspect(no_config, expected)
    scale = {"fp8": ".weight_scale_inv", "int4": ".weight_scale", "mxfp4": "_scales"}[fmt]
    if fmt != "mxfp4":  # gpt-oss's experts are fused: no one expert's scale to lose
        _refused_by_the_loader_and_inspect(_rewrite(path, tmp_path / "c", drop=(f"experts.3.down_proj{scale}",)),
                                           rf"lacks tensors for: .*experts.down_proj:{scale[1:]} \(expert 3\)")
    _refused_by_the_loader_and_inspect(_rewrite(path, tmp_path / "d", drop=(f"down_proj{scale}",)),
                                       f"quantized weights without all their parts: .*down_proj.*{scale[1:]}")
    if fmt == "mxfp4":
        return
    # parts that are all there but do not fit together: scales cut short, scales of another block size
    _refused_by_the_loader_and_inspect(_rewrite(path, tmp_path / "e", truncate=(f"down_proj{scale}",)),
                                       "down_proj(.weight)?: its quantized parts do not fit together")
    if fmt == "fp8":
        wide = {"quantization_config": {**json.loads(open(f"{path}/config.json").read())["quantization_config"],
                                        "weight_block_size": [64, 64]}}
        _refused_by_the_loader_and_inspect(_rewrite(path, tmp_path / "f", wide), "its quantized parts do not fit "
                                                                                 r"together \(scale_inv")


def test_push_keeps_a_quantized_checkpoint_quantized_and_inspect_names_its_format(quantized, tmp_path):
    from moetune.workers.weights.formats import weight_of
    from moetune.workers.weights.push import inspect, push

    fmt, path = quantized
    pushed = f"file://{tmp_path / 'pushed'}"
    push(path, pushed, shard_bytes=40_000)
    index = json.loads((tmp_path / "pushed" / "model.safetensors.index.json").read_text())["weight_map"]
    shards_of = {}
    for name, shard in index.items():  # every weight's parts (codes, scales) share one shard
        shards_of.setdefault(weight_of(name), set()).add(shard)
    assert len(set(index.values())) > 2 and all(len(s) == 1 for s in shards_of.values())
    report = inspect(pushed, ep=2)
    assert report["quantization"] == FORMAT_NAMES[fmt]
    streamed = stream_model(pushed, CPU, F32, cache_dir="")
    assert streamed.verified and streamed.stats.verified_pieces == len(streamed.plan.pieces)
    assert streamed.quantized_bytes == stream_model(f"file://{path}", CPU, F32, cache_dir="").quantized_bytes
