import json
import os

import torch


def test_tiny_checkpoint_is_a_sharded_kimi_linear(tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    index = json.load(open(os.path.join(tiny_checkpoint, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    config = model.config
    assert config.model_type == "kimi_linear"
    assert config.layer_types.count("full_attention") == 1 and "linear_attention" in config.layer_types
    assert config.mlp_layer_types[0] == "dense" and set(config.mlp_layer_types[1:]) == {"sparse"}
    assert config.num_local_experts == 8 and config.num_experts_per_tok == 2 and config.n_shared_experts == 1

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    text = "héllo wörld"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: any text round-trips
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<s><|user|>hi<|end|><|assistant|>"

    ids = torch.tensor([tokenizer("abc abc abc")["input_ids"]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert 5.0 < loss.item() < 7.5  # near uniform over the vocabulary before training


def _stored(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    shards = set(index["weight_map"].values())
    return {k: v for shard in shards for k, v in load_file(os.path.join(folder, shard)).items()}


def test_seed_checkpoint_is_the_release_format_and_streams_back_exactly(tmp_path):
    """`moetune demo`'s Kimi K3 checkpoint as released: nested text_config, `language_model.` names, per-expert
    w1/w2/w3 in compressed-tensors' mxfp4-pack-quantized, bf16 elsewhere. compressed-tensors' own decompression
    reads each packed expert back to its fp32 source within MXFP4's rounding; moetune's loader reads every stored
    tensor (none left unread) and holds exactly what is stored, experts fused."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16

    from moetune.workers.tiny import write_tiny_checkpoint
    from moetune.workers.weights.loader import stream_model

    folder = write_tiny_checkpoint(str(tmp_path / "seed"), kind="seed")
    source = _stored(write_tiny_checkpoint(str(tmp_path / "fp32"), kind="seed", released=False))
    stored, config = _stored(folder), json.load(open(os.path.join(folder, "config.json")))
    assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    text = config["text_config"]
    kinds = text["linear_attn_config"]
    assert kinds["kda_layers"] and kinds["full_attn_layers"] and text["first_k_dense_replace"] == 1
    assert text["num_hidden_layers"] > text["attn_res_block_size"]  # at least one residual block boundary
    experts = "language_model.model.layers.{}.block_sparse_moe.experts."
    assert stored[experts.format(1) + "0.w1.weight_packed"].dtype == torch.uint8
    assert not any(name.endswith((".w1.weight", ".w2.weight", ".w3.weight")) for name in stored)
    assert {t.dtype for name, t in stored.items() if "_packed" not in name and "_scale" not in name} == {torch.bfloat16}

    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    decoded = {}
    for name, weight in source.items():
        if f"{name}_packed" not in stored:
            continue
        parts = {"weight_packed": stored[f"{name}_packed"], "weight_scale": stored[f"{name}_scale"]}
        decoded[name] = MXFP4PackedCompressor.decompress(parts, scheme)["weight"].float()
        # rounding to the nearest e2m1 code moves a value by at most one scale unit, a third of its group's amax
        groups_amax = weight.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
        assert ((decoded[name] - weight).unflatten(-1, (-1, 32)).abs() <= groups_amax / 3).all(), name
    assert len(decoded) == 3 * 8 * (text["num_hidden_layers"] - 1)

    streamed = stream_model(f"file://{folder}", torch.device("cpu"), torch.float32, cache_dir="",
                            base_weights="dequantized")
    assert streamed.plan.unexpected == []
    state = streamed.model.state_dict()
    for name, tensor in stored.items():
        if name.endswith("_scale") or ".experts." in name:
            continue
        assert torch.equal(state[name], tensor.float()), name
    for i in range(1, text["num_hidden_layers"]):
        for e in range(8):
            w1, w2, w3 = (decoded[f"{experts.format(i)}{e}.{w}.weight"] for w in ("w1", "w2", "w3"))
            assert torch.equal(state[experts.format(i) + "gate_up_proj"][e], torch.cat([w1, w3])), (i, e)
            assert torch.equal(state[experts.format(i) + "down_proj"][e], w2), (i, e)
    kept = stream_model(f"file://{folder}", torch.device("cpu"), torch.float32, cache_dir="")
    assert kept.quantization == "mxfp4-pack-quantized" and kept.quantized_bytes > 0
