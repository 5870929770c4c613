"""The memory planner's wire contract (torch-free): a cluster description and a plan request. The plan itself is
the planner's JSON (moetune.workers.planner; `moetune plan`, POST /v1/fine_tuning/plans)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moetune.api.models.job_create import JobCreate

GIB = 2**30
# A GPU's memory in GiB, as the device reports it (torch's total_memory, nvidia-smi's MiB / 1024: an H200's 141 GB
# are 140 GiB): a bare number or G is GiB; GB, MB, TB are powers of ten
_GIBS = {unit: size / GIB for unit, size in {"": GIB, "g": GIB, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
                                              "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": GIB,
                                              "tib": 2**40}.items()}
_MOST_GIB = 65536
_BITS_PER_S = {"": 1, "bps": 1, "kbps": 10**3, "mbps": 10**6, "gbps": 10**9, "tbps": 10**12}


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
    per second)."""

    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(..., ge=1)
    gpus_per_node: int = Field(..., ge=1, le=64)
    # GiB, so that a bare number reads back as it was written
    gpu_memory: float = Field(..., gt=0, description="One GPU's memory in GiB (2^30 bytes) as the device reports it, "
                              "or with a unit: \"140GiB\", \"141GB\" (10^9 bytes)")
    nic: float = Field(100e9, gt=0)

    @field_validator("gpu_memory", mode="before")
    @classmethod
    def _gib(cls, value):
        gib = _quantity(value, _GIBS, "140GiB")
        if gib > _MOST_GIB:  # bytes given as a bare number, which is GiB
            raise ValueError(f"{value!r} GiB is more than any GPU has: a bare number is GiB (bytes take the unit B)")
        return gib

    @field_validator("nic", mode="before")
    @classmethod
    def _bits_per_second(cls, value):
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
