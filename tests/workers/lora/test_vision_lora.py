"""lora.vision on qwen3_5_moe's and glm5_next's tiny models: the vision tower frozen and without LoRA by default,
LoRA on its projector (merger) only, or on every vision linear; refused on a family without image input."""

import pytest

from moetune.workers.errors import JobError
from moetune.workers.families import REGISTRY
from moetune.workers.lora.peft_lora import apply_lora
from bench.support.tiny_models import plain_model
from bench.support.harness import spec


def _lora(family: str, vision: str):
    job = spec(ep=1, zero=2)
    job.lora.vision = vision
    return apply_lora(plain_model(REGISTRY[family]), job.lora)


@pytest.mark.parametrize("family,vision,adapted", [
    ("qwen3_5_moe", "none", set()),
    ("qwen3_5_moe", "projector", {"merger.linear_fc1", "merger.linear_fc2"}),
    ("qwen3_5_moe", "all", {"merger.linear_fc1", "merger.linear_fc2", "blocks.0.attn.qkv", "blocks.0.attn.proj",
                            "blocks.0.mlp.linear_fc1", "blocks.0.mlp.linear_fc2"}),
    ("glm5_next", "projector", {"merger.proj", "merger.gate_proj", "merger.up_proj", "merger.down_proj"}),
])
def test_lora_vision_picks_the_vision_linears(family, vision, adapted):
    model = _lora(family, vision)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    visual = {n.split(".visual.")[1].rsplit(".lora_", 1)[0] for n in trainable if ".visual." in n}
    assert visual == adapted
    assert all(".lora_" in n for n in trainable)  # the tower's own weights stay frozen
    assert any(".language_model." in n for n in trainable)  # the text path keeps its LoRA


def test_lora_vision_is_refused_without_a_vision_tower():
    with pytest.raises(JobError, match="lora.vision: 'all' needs a model whose vision tower moetune trains; "
                                       "kimi_linear models take text only"):
        _lora("kimi_linear", "all")


@pytest.mark.parametrize("vision,layers,adapted", [("projector", (1, 2), {"linear_fc1", "linear_fc2"}),
                                                   ("all", (2, 2), {"linear_fc1", "linear_fc2", "qkv", "proj"})])
def test_coverage_lists_the_vision_layers_lora_vision_adapts(vision, layers, adapted):
    """The coverage table (a job's first LoRA event, `models inspect`) gets a "vision" row, the projector one more
    layer after the blocks, with the LoRA parameters PEFT adds there; none with lora.vision "none"."""
    from moetune.workers.lora.peft_lora import check_targets_on_config

    config = REGISTRY["qwen3_5_moe"].tiny_config().to_dict()
    job = spec(ep=1, zero=2)
    assert "vision" not in check_targets_on_config(config, job.lora).kinds
    job.lora.vision = vision
    table = check_targets_on_config(config, job.lora)
    row = next(r for r in table.rows() if r["layer_type"] == "vision")
    assert (row["adapted_layers"], row["layers"]) == layers and set(row["adapted"]) == adapted
    model = _lora("qwen3_5_moe", vision)
    assert row["trainable_parameters"] == sum(p.numel() for n, p in model.named_parameters() if ".visual." in n
                                              and p.requires_grad)
    assert table.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert "vision" not in dict(table.warnings(job.lora))
