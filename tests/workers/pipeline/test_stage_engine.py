"""Two pipeline stages, each its own DeepSpeed ZeRO-2 engine (workers.engine.pipeline) under
torch.distributed.pipelining's 1F1B schedule, on four gloo ranks: two data-parallel replicas of the pipeline (each
its own rows; a stage's gradients reduced over its two ranks; one rank a stage is its one-replica case) that also
split each stage's experts (EP=2 inside a stage, with expert LoRA: DeepSpeed's expert groups never cross a stage),
Qwen3-MoE and Kimi K3 as released (each rank streaming only its stage's tensors, MXFP4 experts kept packed, its
Attention-Residual blocks across the boundary). Against one process's engine over the unsplit model and every
replica's rows, for two optimizer steps of four micro-batches per replica: the losses, the first step's LoRA
gradients (an expert-parallel rank's: its experts' rows) and each step's gradient norm are equal (DeepSpeed's, which
clipping scales by: every stage must see the whole model's, summed over the stages; the loss is summed over tokens,
so the norm is above the clip). The adapter exported after the two steps (each stage's first rank relays its share
to world rank 0: one file) equals the unsplit engine's; fresh stage engines resumed from the checkpoint written
after step 1 run step 2 to the same loss and the same adapter, bit for bit."""

import os
import zlib

import pytest
import torch
from safetensors.torch import load_file

from bench.support.harness import launch, spec, write_released_checkpoint

MICRO_BATCHES, T, STEPS, STAGES = 4, 12, 2, 2
# the models of each world: Qwen3-MoE's tiny model (four layers) and Kimi K3's tiny model as
# released (MXFP4 experts kept packed; Attention-Residual blocks across the boundary), streamed as a job streams it
SOURCES = {4: ["qwen3_moe", "kimi_k3-released"]}


def _job(world: int):
    """The run config and its pipelined layout: `world` ranks, two stages, world / 2 data-parallel replicas that
    also share each stage's experts (EP = world / 2)."""
    job = spec(ep=world // STAGES, zero=2, world=world, train_experts=True, micro=1,
               global_batch=MICRO_BATCHES * world // STAGES)
    return job, job.parallelism.model_copy(update={"pipeline_parallel_size": STAGES})


def _model(source: str, job, parallelism, folder: str, stage: int | None = None):
    """The model of `source` with the job's LoRA (B random, so every factor has a gradient), its experts placed as
    `parallelism` places them; a released checkpoint streamed as a job streams it, only `stage`'s tensors where
    given (the other stages' stay on the meta device)."""
    from bench.support.harness import base_model
    from bench.support.tiny_models import plain_model
    from moetune.workers.experts.placement import job_placement
    from moetune.workers.families import REGISTRY
    from moetune.workers.model import stage_tensors, trainable_model

    if source in REGISTRY:
        config = REGISTRY[source].tiny_config(num_hidden_layers=4)
        model = plain_model(REGISTRY[source], config=config)
    else:
        held = None if stage is None else stage_tensors(parallelism, stage)
        model = base_model(os.path.join(folder, source), job=job.model_copy(update={"parallelism": parallelism}),
                           held=held)
    model.config.use_cache = model.config.get_text_config().use_cache = False
    torch.manual_seed(1)
    model = trainable_model(model, job.lora, job.training,
                            job_placement(model.config.to_dict(), parallelism, job.lora))
    _random_b(model)
    return model


def _random_b(model) -> None:
    """Every LoRA B drawn from its own name's seed, an expert-parallel module's its experts' rows of the whole
    stack's: the same factors at every layout."""
    from moetune.workers.experts.module import ExpertParallelExperts

    experts = {name: m.ep for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner, _, leaf = name.rpartition(".")
            if "lora_B" not in name and not (leaf.startswith("lora_") and leaf.endswith("_b")):
                continue
            ep = experts.get(owner)
            shape = (ep.num_experts, *p.shape[1:]) if ep else p.shape
            full = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1
            p.copy_(full[ep.local] if ep else full)


def _rows(step: int, replicas: int) -> torch.Tensor:
    """Every replica's rows of the step, replica after replica."""
    return torch.randint(3, 256, (replicas * MICRO_BATCHES, T), generator=torch.Generator().manual_seed(10 + step))


def _full_grads(model, params) -> dict:
    from deepspeed.utils import safe_get_full_grad

    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: safe_get_full_grad(p).clone() for p in params}


def _stages(rank: int, world: int, out_dir: str) -> None:
    from moetune.workers.engine.deepspeed import init_comm

    init_comm()
    for source in SOURCES[world]:
        _stage_run(rank, world, source, out_dir)


def _stage_engine(source: str, world: int, rank: int, out_dir: str):
    """This rank's model, stage module, engine, pipeline stage and what saving from it needs."""
    from moetune.workers.checkpoints.stage_relay import PipelinedModel
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.engine.pipeline import EngineStage, StageGroups
    from moetune.workers.pipeline.split import stage_bounds
    from moetune.workers.pipeline.stages import stage_module

    job, parallelism = _job(world)
    place = parallelism.coordinates(rank)
    model = _model(source, job, parallelism, out_dir, place.stage)
    layers = model.config.get_text_config().num_hidden_layers
    module = stage_module(model, stage_bounds(layers, STAGES), place.stage)
    groups = StageGroups(parallelism, rank)
    engine, _ = build_engine(module, job.training, parallelism, world, STEPS, bf16=False, groups=groups)
    stage = EngineStage(engine, place.stage, STAGES, torch.device("cpu"), group=groups.model)
    return model, module, engine, stage, PipelinedModel(model, place.stage, parallelism.stage_first_ranks)


def _train_step(stage, step: int, rank: int, world: int) -> float:
    """The micro-batches of this rank's replica through 1F1B (the optimizer step is the caller's): their summed
    loss on the last stage, 0 elsewhere."""
    from torch.distributed.pipelining import Schedule1F1B

    from moetune.workers.methods.sft import token_loss_sum

    _, parallelism = _job(world)
    place, replicas = parallelism.coordinates(rank), parallelism.data_parallel_size

    def loss_fn(logits, target):  # DeepSpeed averages over the replicas: their sum, as the unsplit step takes it
        return token_loss_sum(logits, target) * replicas

    schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn, scale_grads=False)
    mine = _rows(step, replicas)[place.data_rank * MICRO_BATCHES:(place.data_rank + 1) * MICRO_BATCHES]
    micro = []
    if place.stage == 0:
        schedule.step(mine)
    else:
        schedule.step(target=mine, losses=micro)
    return float(sum(micro)) / replicas


def _stage_run(rank: int, world: int, source: str, out_dir: str) -> None:
    """Two steps, a checkpoint after the first and the adapter after the second; then fresh engines resume from
    the checkpoint, run the second step again and export the adapter again."""
    from moetune.workers.checkpoints.save import load_checkpoint, save_adapter, save_checkpoint
    from moetune.workers.experts.module import ExpertParallelExperts

    model, module, engine, stage, pipelined = _stage_engine(source, world, rank, out_dir)
    params = [p for p in module.parameters() if p.requires_grad]
    saved = os.path.join(out_dir, f"{source}-checkpoint")
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        loss = _train_step(stage, step, rank, world)
        grads = grads or _full_grads(model, params)
        stage.step()
        losses.append(loss)
        norms.append(float(engine.get_global_grad_norm()))
        if step == 0:
            save_checkpoint(engine, saved, is_writer=rank == 0, pipelined=pipelined)
    save_adapter(engine, os.path.join(out_dir, f"{source}-pipelined-adapter"), rank == 0, pipelined=pipelined)
    packed = sum(m.quantized for m in module.modules() if isinstance(m, ExpertParallelExperts))
    mine = {id(p) for p in module.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in mine and not p.is_meta]

    _, _, engine, stage, pipelined = _stage_engine(source, world, rank, out_dir)
    load_checkpoint(engine, saved, pipelined.stage)
    resumed = _train_step(stage, 1, rank, world)
    stage.step()
    save_adapter(engine, os.path.join(out_dir, f"{source}-resumed-adapter"), rank == 0, pipelined=pipelined)
    torch.save({"grads": grads, "losses": losses, "norms": norms, "packed_expert_layers": packed,
                "loaded_outside_stage": outside, "resumed_loss": resumed},
               os.path.join(out_dir, f"{source}-{rank}.pt"))


def _unsplit(rank: int, world: int, pipelined_world: int, out_dir: str) -> None:
    for source in SOURCES[pipelined_world]:
        _unsplit_run(source, pipelined_world, out_dir)


def _unsplit_run(source: str, pipelined_world: int, out_dir: str) -> None:
    from moetune.workers.checkpoints.save import save_adapter
    from moetune.workers.engine.deepspeed import build_engine, init_comm
    from moetune.workers.methods.sft import token_loss_sum

    init_comm()
    job, parallelism = _job(pipelined_world)
    one = job.parallelism.model_copy(update={"num_workers": 1, "expert_parallel_size": 1})
    model = _model(source, job, one, out_dir)
    engine, _ = build_engine(model, job.training, one, 1, STEPS, bf16=False)
    params = [p for p in model.parameters() if p.requires_grad]
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        rows, total = _rows(step, parallelism.data_parallel_size), 0.0
        for m in range(len(rows)):
            loss = token_loss_sum(engine(input_ids=rows[m:m + 1]).logits, rows[m:m + 1])
            engine.set_gradient_accumulation_boundary(m == len(rows) - 1)
            engine.backward(loss, scale_wrt_gas=False)
            if m == len(rows) - 1 and grads is None:
                grads = _full_grads(model, params)
            engine.step()
            total += loss.item()
        losses.append(total)
        norms.append(float(engine.get_global_grad_norm()))
    save_adapter(engine, os.path.join(out_dir, f"{source}-unsplit-adapter"), is_writer=True)
    torch.save({"grads": grads, "losses": losses, "norms": norms}, os.path.join(out_dir, f"{source}-unsplit.pt"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [4])
def test_stages_under_their_own_engines_step_as_the_unsplit_model(tmp_path, world):
    if "kimi_k3-released" in SOURCES[world]:
        write_released_checkpoint(str(tmp_path / "kimi_k3-released"), "kimi_k3")
    launch(_stages, world, str(tmp_path))
    launch(_unsplit, 1, world, str(tmp_path))
    ep = world // STAGES
    for source in SOURCES[world]:
        ranks = [torch.load(tmp_path / f"{source}-{r}.pt") for r in range(world)]
        want = torch.load(tmp_path / f"{source}-unsplit.pt")
        last_stage = ranks[world // STAGES:]
        assert [sum(rank["losses"][i] for rank in last_stage) for i in range(STEPS)] == \
            pytest.approx(want["losses"], rel=1e-6), source
        assert min(want["norms"]) > 1.0  # above the clip: the steps are scaled by it
        for rank in ranks:
            assert rank["norms"] == pytest.approx(want["norms"], rel=1e-5), source
        assert sorted({n for rank in ranks for n in rank["grads"]}) == sorted(want["grads"])
        assert any(".experts.lora_down_b" in name for name in want["grads"])
        # the released K3's experts stay MXFP4 on every stage, and each rank loaded its stage's tensors only
        assert all(bool(rank["packed_expert_layers"]) == (source != "qwen3_moe") for rank in ranks), source
        assert all(not rank["loaded_outside_stage"] for rank in ranks) or source == "qwen3_moe"
        # the checkpoint after step 1 resumed: the same step 2, the same adapter; and that adapter is the unsplit one
        assert [rank["resumed_loss"] for rank in ranks] == [rank["losses"][1] for rank in ranks], source
        adapters = {kind: load_file(tmp_path / f"{source}-{kind}-adapter" / "adapter_model.safetensors")
                    for kind in ("pipelined", "resumed", "unsplit")}
        assert adapters["pipelined"].keys() == adapters["unsplit"].keys() == adapters["resumed"].keys()
        assert any(".experts." in key for key in adapters["unsplit"]), source
        for key, unsplit in adapters["unsplit"].items():
            assert torch.equal(adapters["resumed"][key], adapters["pipelined"][key]), (source, key)
            # Adam's steps (lr 1e-2) amplify the float differences of summing in another order up to ~3e-5; a
            # missing or stale stage's share differs by a whole step
            assert (adapters["pipelined"][key] - unsplit).abs().max() <= 1e-4, (source, key)
        for r, rank in enumerate(ranks):
            for name, got in rank["grads"].items():
                expected = want["grads"][name]
                if ".experts." in name:  # this rank's experts of the stack
                    expected = expected.chunk(ep)[r % ep]
                assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), (source, name)
