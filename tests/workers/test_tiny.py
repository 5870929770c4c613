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
