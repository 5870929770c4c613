"""The job's `parallelism` section: workers, GPUs per worker, expert parallelism, the ZeRO stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from moetune.api.models.base import SpecError, StrictModel


class ParallelismSpec(StrictModel):
    num_workers: int = Field(1, ge=1, le=4096)
    gpus_per_worker: int = Field(0, ge=0, le=16)  # 0 = CPU workers (gloo)
    expert_parallel_size: int = Field(1, ge=1)
    zero_stage: Literal[1, 2, 3] = 2

    def worker_resources(self) -> dict[str, float]:
        """The Ray resources of one training worker (its placement bundle): the driver asks Ray Train for these,
        the scheduler checks the cluster has them before it submits."""
        return {"CPU": 1, "GPU": self.gpus_per_worker} if self.gpus_per_worker else {"CPU": 1}

    @property
    def collective_forward(self) -> bool:
        """Whether a forward itself runs collectives (expert all-to-all, ZeRO-3 parameter gathers): every rank must
        then run each forward with its peers."""
        return self.expert_parallel_size > 1 or self.zero_stage == 3

    def check_expert_split(self, routed_experts: int | None = None) -> None:
        """The control plane's one check that EP divides the workers and the routed experts (`routed_experts`, once
        the model's config.json is read); the workers' one is workers.experts.placement.ExpertPlacement."""
        if self.num_workers % self.expert_parallel_size:
            raise SpecError("parallelism.expert_parallel_size", "must divide parallelism.num_workers")
        if routed_experts is not None and routed_experts % self.expert_parallel_size:
            raise SpecError("parallelism.expert_parallel_size", f"must divide the model's {routed_experts} routed "
                                                                f"experts (got {self.expert_parallel_size})")
