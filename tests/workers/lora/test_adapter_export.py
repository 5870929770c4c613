"""The exported adapter config survives PEFT 0.21's load-time v4 -> v5 target conversion (one process, no engine)."""

import pytest
import torch

from moetune.api.models.lora import LoraSpec
from bench.support.tiny_models import batch, plain_model


@pytest.mark.parametrize("family_name", ["deepseek_v3", "qwen3_next"])
def test_shared_expert_and_dense_mlp_lora_load_as_trained(tmp_path, family_name):
    """These families' shared experts / dense MLPs have `gate_proj`/`up_proj`/`down_proj` linears, names PEFT would
    move onto the routed experts when loading. With dropout on, which parameter LoRA cannot take."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import save_file

    from moetune.workers.experts.lora_layout import loadable_adapter_config
    from moetune.workers.families import REGISTRY
    from moetune.workers.lora.peft_lora import apply_lora

    fam = REGISTRY[family_name]
    trained = apply_lora(plain_model(fam), LoraSpec(rank=4, alpha=8.0, dropout=0.1, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    config = loadable_adapter_config(trained.peft_config["default"], trained.config.model_type, expert_in_proj=None)
    config.save_pretrained(tmp_path)
    save_file(get_peft_model_state_dict(trained), tmp_path / "adapter_model.safetensors")

    loaded = PeftModel.from_pretrained(plain_model(fam), str(tmp_path)).eval()
    assert any(f".{fam.shared_experts}.gate_proj.lora_B" in n for n, _ in loaded.named_parameters())
    assert not any(".experts." in n and "lora_" in n for n, _ in loaded.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch(0, step=99)).logits, trained.eval()(**batch(0, step=99)).logits,
                                   rtol=1e-4, atol=1e-5)
