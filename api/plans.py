"""The memory planner's wire contract (torch-free): a cluster description, a plan request and the plan, whose
layouts are the request's own ParallelDims with activation checkpointing and a micro-batch
(moetune.workers.planner answers it; `moetune plan`, POST /v1/fine_tuning/plans, submission's fit check)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moetune.api.models.job_create import JobCreate
from moetune.api.models.parallelism import ParallelDims

GIB = 2**30
# A GPU's memory in GiB, as the device reports it (torch's total_memory, nvidia-smi's MiB / 1024: an H200's 141 GB
# are 140 GiB): a bare number or G is GiB; GB, MB, TB are powers of ten
_GIBS = {unit: size / GIB for unit, size in {"": GIB, "g": GIB, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
                                              "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": GIB,
                                              "tib": 2**40}.items()}
_MOST_GIB = 65536
_BITS_PER_S = {"": 1, "bps": 1, "kbps": 10**3, "mbps": 10**6, "gbps": 10**9, "tbps": 10**12}
_BYTES_PER_S = {"MB/s": 8 * 10**6, "GB/s": 8 * 10**9, "TB/s": 8 * 10**12}  # NVLink's usual unit (case matters)


def _quantity(value, units: dict[str, int], example: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"{value!r} is not a quantity like {example!r} (units: {', '.join(filter(None, units))})")
    return float(match.group(1)) * units[match.group(2).lower()]


class ClusterSpec(BaseModel):
    """GPUs the job may run on. `gpu_memory`: one GPU's memory in GiB (2^30 bytes) as the device reports it ("140",
    "140GiB", "140G"; "80GB" is 80·10^9 bytes); `nic`: one node's network bandwidth to storage ("400Gbps" or bits
    per second). For the time estimates: one GPU's dense bf16 peak (`gpu_tflops`) and the share of it the job's
    kernels reach (`efficiency`), its NVLink bandwidth each way (`nvlink`) and its own network link to other
    nodes (`network`); the defaults are an H100/H200 SXM node's stated figures and a stated 40 %."""

    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(..., ge=1)
    gpus_per_node: int = Field(..., ge=1, le=64)
    # GiB, so that a bare number reads back as it was written
    gpu_memory: float = Field(..., gt=0, description="One GPU's memory in GiB (2^30 bytes) as the device reports it, "
                              "or with a unit: \"140GiB\", \"141GB\" (10^9 bytes)")
    nic: float = Field(100e9, gt=0)
    gpu_tflops: float = Field(989.0, gt=0, description="One GPU's dense bf16 peak in TFLOP/s (H100/H200 SXM: 989)")
    efficiency: float = Field(0.4, gt=0, le=1, description="The share of the peak the job's kernels reach "
                              "(stated; bench/gpu_check.py measures it on a GPU)")
    nvlink: float = Field(3.6e12, gt=0, description="One GPU's NVLink bandwidth each way (\"450GB/s\", bits/s)")
    network: float = Field(400e9, gt=0, description="One GPU's network bandwidth to other nodes (\"400Gbps\")")
    overlap: bool = Field(True, description="ZeRO-3's prefetched gathers run beside the compute (on GPUs, on their "
                          "own stream); false where a collective blocks the rank (CPU ranks over gloo)")

    @field_validator("gpu_memory", mode="before")
    @classmethod
    def _gib(cls, value):
        gib = _quantity(value, _GIBS, "140GiB")
        if gib > _MOST_GIB:  # bytes given as a bare number, which is GiB
            raise ValueError(f"{value!r} GiB is more than any GPU has: a bare number is GiB (bytes take the unit B)")
        return gib

    @field_validator("nic", "nvlink", "network", mode="before")
    @classmethod
    def _bits_per_second(cls, value):
        text = str(value).strip()
        for unit, bits in _BYTES_PER_S.items():
            if text.endswith(unit):
                return _quantity(text.removesuffix(unit), {"": 1}, "450GB/s") * bits
        return _quantity(value, _BITS_PER_S, "400Gbps")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_memory_bytes(self) -> float:
        return self.gpu_memory * GIB


def parse_cluster(text: str) -> ClusterSpec:
    """`nodes=8,gpus_per_node=8,gpu_memory=140GiB,nic=400Gbps` (the CLI's and MOETUNE_CLUSTER's form); a
    ValueError says what is wrong."""
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r}: expected key=value")
        fields[key.strip()] = value.strip()
    return ClusterSpec.model_validate(fields)


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job: JobCreate
    cluster: ClusterSpec


class PlannedTime(BaseModel):
    """A layout's estimated optimizer step (workers.planner.timing): every figure an estimate from the inputs the
    plan's assumptions name. `seconds`: the step's time by kind, the pipeline's slowest stage's (compute, ZeRO-3's
    gathers, the expert all-to-all, the context-parallel exchange, the pipeline's sends, the LoRA gradients'
    reduction); the step overlaps compute with ZeRO-3's prefetched gathers (where the cluster says they overlap),
    nothing else."""

    step_seconds: float
    tokens_per_second_per_gpu: float
    micro_batches: int  # per optimizer step on one rank (pipeline: per stage)
    bubble_fraction: float  # of the step a pipeline stage waits (0 without stages)
    flops_per_token: float  # the model's training operations per token (forward, recomputation, backward)
    seconds: dict[str, float]


class PlannedLayout(BaseModel):
    """One layout's memory per GPU (bytes): in training (`bytes` by part, on its pipeline stage that holds most)
    and at load; its estimated step time; whether a job can run it yet (`available`)."""

    parallelism: ParallelDims
    activation_checkpointing: bool
    micro_batch_size: int
    bytes: dict[str, Any]  # part -> bytes, or a part's own parts -> bytes
    total_bytes: float
    load_bytes: dict[str, Any]
    load_total_bytes: float
    fits: bool
    tuner_start_micro_batch: int | None = None  # the recommended layout's: the largest micro-batch that fits
    gpus_available: bool | None = None  # the submitted layout's: the cluster has that many GPUs
    time: PlannedTime | None = None
    available: bool = True  # False: a job of the planned configuration cannot run it (run_config.pipeline_refusal)

    def describe(self) -> str:
        """The layout in the words of the request's fields (submission's 422 names it)."""
        par = self.parallelism
        split = "".join(f", {name} {size}" for name, size in (("context_parallel_size", par.context_parallel_size),
                                                             ("pipeline_parallel_size", par.pipeline_parallel_size))
                        if size > 1)
        return (f"{par.num_workers} GPUs, expert_parallel_size {par.expert_parallel_size}{split}, zero_stage "
                f"{par.zero_stage}, activation_checkpointing {str(self.activation_checkpointing).lower()}")


class PlannedModel(BaseModel):
    model_type: str | None
    parameters: int
    quantization: str | None
    routed_experts: int
    experts_per_token: int
    lora_parameters: int
    expert_lora_parameters: int


class PlannedCluster(BaseModel):
    nodes: int
    gpus_per_node: int
    gpus: int
    gpu_memory: float  # bytes, as every size in a plan
    gpu_memory_gib: float  # as the request's gpu_memory takes it
    nic: float
    usable_bytes_per_gpu: float
    gpu_tflops: float  # the time estimates' inputs (ClusterSpec's)
    efficiency: float
    nvlink: float
    network: float
    overlap: bool


class PlannedLoad(BaseModel):
    """Streaming the base at the start: what a rank and a node read, and how long a node's NIC takes."""

    bytes_per_rank: float
    bytes_per_node: float
    seconds: float
    expert_parallel_size: int


class Plan(BaseModel):
    model: PlannedModel
    cluster: PlannedCluster
    seq_len: int
    compute_dtype_bytes: int
    activation_bytes_per_token: dict[str, float]
    submitted: PlannedLayout
    recommended: PlannedLayout | None  # the fastest layout of the submitted workers that fits and runs
    runner_up: PlannedLayout | None = None  # the next fastest after it, and why it is slower
    runner_up_slower: str | None = None
    tradeoffs: list[PlannedLayout] = []  # the fitting layouts of the submitted workers, fastest first
    fewest_gpus: PlannedLayout | None  # the fewest GPUs any layout fits on
    load: PlannedLoad
    assumptions: str
