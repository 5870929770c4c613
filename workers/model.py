"""The one builder of a model, for training (`train`), serving (`serve`) and the planner (`meta`), in one order (as
torchtitan's model spec + parallelize_*): family spec (workers.families) → checkpoint plan (this rank's routed
experts) → weights streamed (workers.weights; under ZeRO-3 into each rank's partition as they load; the meta
device for the planner) → kernel swaps → PEFT LoRA
(workers.lora) → expert parallelism (workers.experts) → training only: LoRA in the compute dtype, activation
checkpointing. The engine (workers.engine) is the loop's: it is built over `Built.model` once the data says how many
steps it runs and the method has set up its output layer (workers.methods sits beside this room, not below it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from moetune.api.errors import ErrorCode
from moetune.api.models.lora import LoraSpec
from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.run_config import RunConfig, RunTraining
from moetune.api.models.training import TrainingSpec
from moetune.workers.engine.zero3_load import Zero3Partitioner
from moetune.workers.errors import JobError
from moetune.workers.experts.module import parallelize, quantized_experts
from moetune.workers.experts.placement import ExpertPlacement, job_placement, needs_expert_module, placement_at
from moetune.workers.families import auto_model_class, family_for, hf_config
from moetune.workers.families.spec import Family
from moetune.workers.lora.fused_linear import fuse_lora_linears
from moetune.workers.lora.peft_lora import apply_lora
from moetune.workers.pipeline.stages import model_stage_bounds, stage_tensor_names
from moetune.workers.recompute import enable_activation_checkpointing
from moetune.workers.weights.loader import StreamedModel, stream_model

Mode = Literal["train", "serve", "meta"]
TRAIN, SERVE, META = "train", "serve", "meta"


def load_tokenizer(local_dir: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    if tokenizer.eos_token_id is None:
        raise JobError(ErrorCode.invalid_model, "the model's tokenizer has no eos token", "model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of loss and attention anyway
    return tokenizer


def load_dtype(device):
    """bf16 on GPUs, fp32 on CPU (where bf16 matmuls are slow)."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass(frozen=True)
class WeightsSource:
    """Where `train` and `serve` stream the weights from: the checkpoint and the node's weights cache (None or "":
    none; `cache_max_bytes` None: bounded by free disk)."""

    uri: str
    cache_dir: str | None = None
    cache_max_bytes: int | None = None


@dataclass
class Built:
    model: Any  # train, meta: the PEFT model; serve: the base, frozen, in eval mode
    family: Family
    placement: ExpertPlacement | None  # this rank's routed experts (None: the model has none)
    streamed: StreamedModel | None  # the load's figures (None on the meta device)
    swapped: dict[str, int]  # kernel swap -> modules it changed
    base: Any = None  # what `read_base` answered


def build_model(mode: Mode, config: dict, job: RunConfig | None = None, *, device=None, dtype=None,
                weights: WeightsSource | None = None, read_base: Callable[[Any, Family], Any] | None = None,
                stage: int = 0) -> Built:
    """The model of `config` (the checkpoint's config.json) for `mode`.

    `job`: the job's run config (train, meta); serving has none: no LoRA (adapters are applied per row,
    workers.generate), every kernel swap, the base as stored. `dtype`: the compute dtype (default:
    load_dtype(device)). `read_base` is called with the base as built (weights or meta) and its family, before any
    swap: what a caller reads of the checkpoint's own modules (the planner its tensors, serving its expert layout); its answer is `Built.base`.
    `train` needs torch.distributed up (the expert process groups) and every rank to have drawn the same random
    state (LoRA init); with pipeline stages it streams only the tensors of the rank's `stage` (the others stay on
    the meta device)."""
    family = family_for(config)
    placement = job_placement(config, job.parallelism, job.lora) if mode == TRAIN else placement_at(config, 1, 0)
    dtype = dtype or load_dtype(device)
    streamed = None
    if mode == META:
        model = meta_model(config, dtype)
    else:
        streamed = stream_model(weights.uri, device, dtype, placement, weights.cache_dir, weights.cache_max_bytes,
                                job.training.base_weights if job else "quantized",
                                load_partitioner(job.training, job.parallelism, device) if mode == TRAIN else None,
                                held=stage_tensors(job.parallelism, stage) if mode == TRAIN else None)
        model = streamed.model
    base = read_base(model, family) if read_base else None
    custom_kernels = job.training.custom_kernels if job else True
    swapped = family.apply_kernel_swaps(model) if custom_kernels else {}
    adapted = _adapted(mode, model, family, job.lora if job else None, job.training if job else None, placement)
    return Built(adapted, family, placement, streamed, swapped, base)


def stage_tensors(parallelism: ParallelDims, stage: int) -> Callable[[Any], set[str]] | None:
    """stream_model's `held` for a rank of pipeline stage `stage` (None without stages: every tensor)."""
    if parallelism.pipeline_parallel_size == 1:
        return None
    return lambda meta: stage_tensor_names(meta, model_stage_bounds(meta, parallelism.pipeline_parallel_size),
                                           stage)


def load_partitioner(training: RunTraining, parallelism: ParallelDims, device) -> Zero3Partitioner | None:
    """Under ZeRO-3, what puts each frozen parameter into its partition as it loads (bf16 on GPUs, as the engine
    the loop builds): no rank holds its whole share of the base at once. None for ZeRO-1/2."""
    if parallelism.zero_stage != 3:
        return None
    return Zero3Partitioner(training, parallelism, parallelism.num_workers, bf16=device.type == "cuda")


def meta_model(config: dict, dtype):
    """The model of `config` with every tensor on the meta device: shapes only, any size, in seconds."""
    import torch

    with torch.device("meta"):
        return auto_model_class(config).from_config(hf_config(config), dtype=dtype)


def trainable_model(model, lora: LoraSpec, training: TrainingSpec, placement: ExpertPlacement | None):
    """`train`'s steps after the kernel swaps, on a model whose weights are in (tests and benchmarks build a plain
    transformers model and swap its kernels themselves); `lora` and `training`: the job's sections.
    Activation checkpointing is on only where `training.activation_checkpointing` is True (a run config's is a
    bool; a request's "auto" means off here)."""
    return _adapted(TRAIN, model, family_for(model.config), lora, training, placement)


def _adapted(mode: Mode, model, family: Family, lora: LoraSpec | None, training: TrainingSpec | None,
             placement: ExpertPlacement | None):
    """LoRA (serving has none: its adapters are applied per row; fused with `training.custom_kernels`), then expert
    parallelism (stand-ins on the meta device), then what training alone needs: LoRA in the compute dtype,
    activation checkpointing. `lora` and `training`: the job's sections (None when serving)."""
    dtype = model.dtype  # the compute dtype: that of the dense weights (a quantized base keeps some: embeddings)
    if lora is not None:
        model = apply_lora(_no_kv_cache(model), lora)
        if training is None or training.custom_kernels:
            fuse_lora_linears(model)
    if mode == META:
        install_stand_ins(model, family)
        return model.train()
    if runs_expert_module(placement, lora, quantized_experts(model, family), serving=mode == SERVE):
        parallelize(model, family, placement, lora, training.custom_kernels if training else True)
    if mode == SERVE:
        return model.requires_grad_(False)
    # PEFT puts a linear's LoRA in its weight's dtype; a quantized weight has no such dtype, so LoRA joins the
    # compute dtype here, like every other trainable tensor
    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)
    if training.activation_checkpointing is True:
        enable_activation_checkpointing(model)
    return model


def runs_expert_module(placement: ExpertPlacement | None, lora: LoraSpec | None, quantized: bool,
                       serving: bool = False) -> bool:
    """Whether the routed experts leave the family's module for moetune's expert-parallel one: they are sharded,
    get their own LoRA, are kept quantized (the family's module cannot run them), or are served (per-row expert
    adapters wrap moetune's module, workers.generate)."""
    return placement is not None and (serving or quantized or needs_expert_module(placement, lora))


def _no_kv_cache(model):
    """A model that trains (or is planned as it trains) builds no KV cache and keeps none."""
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.use_cache = False
    return model


class RoutedStandIn(nn.Module):
    """The routed experts on the meta device, which cannot route tokens (counts, sorts and splits read data):
    saves nothing; the planner adds the experts' share for each layout it considers (planner.experts)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states * 0.0  # a product with a number saves no tensor


def install_stand_ins(model, family: Family) -> None:
    for _, block in family.moe_blocks(model):
        setattr(block, family.experts, RoutedStandIn())
