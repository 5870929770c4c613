"""The memory planner's wire contract (torch-free): a cluster description and a plan request. The plan itself is
the planner's JSON (moetune.workers.planner; `moetune plan`, POST /v1/fine_tuning/plans)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moetune.api.models.job_create import JobCreate

_BYTES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_BITS_PER_S = {"": 1, "bps": 1, "kbps": 10**3, "mbps": 10**6, "gbps": 10**9, "tbps": 10**12}


def _quantity(value, units: dict[str, int], example: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"{value!r} is not a quantity like {example!r} (units: {', '.join(units)})")
    return float(match.group(1)) * units[match.group(2).lower()]


class ClusterSpec(BaseModel):
    """GPUs the job may run on. `gpu_memory`: bytes of one GPU ("141GB", "80GiB" or a number of bytes); `nic`:
    one node's network bandwidth to storage ("400Gbps" or bits per second)."""

    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(..., ge=1)
    gpus_per_node: int = Field(..., ge=1, le=64)
    gpu_memory: float = Field(..., gt=0)
    nic: float = Field(100e9, gt=0)

    @field_validator("gpu_memory", mode="before")
    @classmethod
    def _bytes(cls, value):
        return _quantity(value, _BYTES, "141GB")

    @field_validator("nic", mode="before")
    @classmethod
    def _bits_per_second(cls, value):
        return _quantity(value, _BITS_PER_S, "400Gbps")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def parse_cluster(text: str) -> ClusterSpec:
    """`nodes=8,gpus_per_node=8,gpu_memory=141GB,nic=400Gbps` (the CLI's and MOETUNE_CLUSTER's form); a
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
