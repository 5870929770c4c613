import json
import os

import pytest

from moetune.api.models.lora import LoraSpec
from moetune.workers.errors import JobError
from moetune.workers.lora.peft_lora import apply_lora, check_targets_on_config


def test_all_linear_lora_leaves_router_and_experts_frozen(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), LoraSpec(rank=4, alpha=8))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    names = " ".join(trainable)
    assert "shared_experts" in names and "self_attn.q_proj" in names and "lm_head" not in names
    assert not [n for n, _ in model.named_modules() if n.endswith("mlp.gate.lora_A")]


def test_unknown_target_modules_list_what_exists(tiny_checkpoint):
    config = json.load(open(os.path.join(tiny_checkpoint, "config.json")))
    check_targets_on_config(config, LoraSpec(target_modules=["q_proj", "down_proj"]))
    with pytest.raises(JobError) as err:
        check_targets_on_config(config, LoraSpec(target_modules=["q_proj", "wq"]))
    assert err.value.param == "lora.target_modules"
    assert "'wq'" in err.value.message and "o_proj" in err.value.message
