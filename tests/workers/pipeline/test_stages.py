"""A model split into 4 pipeline stages (first, middle and last) on gloo ranks (workers.pipeline), run by
torch.distributed.pipelining's 1F1B schedule over four micro-batches, equals the unsplit model on the summed loss and
every LoRA gradient, each with its kernel swaps: Qwen3-MoE and Kimi-Linear (hidden states across each boundary) and
Kimi K3 (the running Attention-Residual block sum and every completed block's across each boundary; at 4 stages the
boundaries fall inside its 2-layer blocks too)."""

import os

import pytest
import torch

from bench.support.harness import launch
from moetune.workers.pipeline.split import stage_bounds

MICRO_BATCHES, T = 4, 12
FAMILIES = ["qwen3_moe", "kimi_linear", "kimi_k3"]
LAYERS = {"qwen3_moe": {"num_hidden_layers": 4}}  # a layer for each of 4 stages (the others' tiny models have 4)
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj", "q_proj", "k_proj",
           "v_proj", "f_a_proj", "f_b_proj", "b_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(family_name: str):
    """The family's tiny model with its kernel swaps and LoRA on its text model (B random too, so every factor has
    a gradient): the same weights in every process."""
    from peft import LoraConfig, inject_adapter_in_model

    from bench.support.tiny_models import plain_model
    from moetune.workers.families import REGISTRY

    family = REGISTRY[family_name]
    config = family.tiny_config(**LAYERS.get(family_name, {}))
    config.use_cache = config.get_text_config().use_cache = False  # as workers.model sets it for training
    model = plain_model(family, config=config)
    family.apply_kernel_swaps(model)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, exclude_modules=r".*(vision|visual).*",
                      init_lora_weights=False)
    inject_adapter_in_model(lora, model)
    return model


def rows() -> torch.Tensor:
    return torch.randint(3, 256, (MICRO_BATCHES, T), generator=torch.Generator().manual_seed(2))


def lora_grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if "lora_" in name and p.grad is not None}


def _ranks(rank: int, world: int, out_dir: str, family_names: list[str]) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from moetune.workers.methods.sft import token_loss_sum
    from moetune.workers.pipeline.stages import stage_module

    results = {}
    for family_name in family_names:
        model = tiny(family_name)
        bounds = stage_bounds(model.config.get_text_config().num_hidden_layers, world)
        stage = PipelineStage(stage_module(model, bounds, rank), rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=token_loss_sum, scale_grads=False)
        losses = []
        if rank == 0:
            schedule.step(rows())
        elif rank == world - 1:
            schedule.step(target=rows(), losses=losses)
        else:
            schedule.step()
        results[family_name] = {"grads": lora_grads(model), "loss": float(sum(losses))}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore:You have passed exclude_modules")  # a family without a vision tower
@pytest.mark.parametrize("world", [4])
def test_a_model_split_into_pipeline_stages_equals_the_unsplit_model(tmp_path, world):
    from moetune.workers.methods.sft import token_loss_sum

    launch(_ranks, world, str(tmp_path), FAMILIES)  # one launch: the ranks' start is the cost
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for family_name in FAMILIES:
        results = [rank[family_name] for rank in ranks]
        model = tiny(family_name)
        ids = rows()
        loss = token_loss_sum(model(input_ids=ids).logits, ids)
        loss.backward()
        assert results[-1]["loss"] == pytest.approx(loss.item(), rel=1e-5), family_name
        want = lora_grads(model)
        owners = [name for result in results for name in result["grads"]]
        assert sorted(owners) == sorted(want), f"{family_name}: each LoRA factor trains on exactly one stage"
        got = {name: grad for result in results for name, grad in result["grads"].items()}
        for name, expected in want.items():
            assert (got[name] - expected).abs().max() <= 1e-5 * expected.abs().max(), (family_name, name)
