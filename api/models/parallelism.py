"""The job's parallel layout (its `parallelism` section), the one type from the request to the process groups:
workers, devices per worker, the data, expert, context and pipeline sizes and the ZeRO stage. Every divisibility
rule is checked here, against the workers (`check_world`) and against the model (`check_model`), and each rank's
coordinates and group members derive from it.

Rank order, outermost first: pipeline stage, data-parallel index, context index. A stage holds world / pipeline
consecutive ranks; its expert-parallel groups are consecutive blocks of `expert_parallel_size` among them, so EP
ranks may be data or context peers (their tokens differ either way). DeepSpeed makes its expert groups in that
same order (workers.engine.experts checks that they agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from moetune.api.models.base import SpecError, StrictModel

# The rules between the sizes and the model are api.families.check_model_spec's; those between the sizes, the method
# and the training section api.models.run_config's (pipeline_refusal, micro_batches_refusal, context_parallel_refusal).


def expert_group_name(expert_parallel_size: int) -> str:
    """DeepSpeed's name of an expert-parallel group (its groups dictionary is keyed by it)."""
    return f"ep_size_{expert_parallel_size}"


@dataclass(frozen=True)
class Coordinates:
    """One world rank's place in the layout."""

    world_rank: int
    stage: int  # pipeline stage
    data_rank: int  # index among the stage's data-parallel replicas
    context_rank: int  # index in its context-parallel group
    ep_rank: int  # index in its expert-parallel group
    expert_group: int  # which EP group of its stage


class ParallelDims(StrictModel):
    num_workers: int = Field(1, ge=1, le=4096)  # training ranks: one per worker
    gpus_per_worker: int = Field(0, ge=0, le=16)  # 0 = CPU workers (gloo)
    expert_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    zero_stage: Literal[1, 2, 3] = 2

    # -------------------------------------------------------------- rules

    def check_world(self) -> None:
        """The rules between the sizes and the worker count; a SpecError names the field. Called where a layout
        enters (resolve_run_config, a session's creation), so the message keeps its field path."""
        if self.gpus_per_worker > 1:  # a worker is one rank and drives one device: the rest would sit idle
            raise SpecError("parallelism.gpus_per_worker",
                            f"must be 0 (CPU workers) or 1: each worker is one training rank on one GPU; for "
                            f"{self.num_workers * self.gpus_per_worker} GPUs ask for num_workers: "
                            f"{self.num_workers * self.gpus_per_worker} with gpus_per_worker: 1")
        split = self.pipeline_parallel_size * self.context_parallel_size
        if self.num_workers % split:
            raise SpecError("parallelism.num_workers", f"must be a multiple of pipeline_parallel_size x "
                                                       f"context_parallel_size = {split}")
        if self.pipeline_parallel_size > 1 and self.zero_stage == 3:
            # DeepSpeed's ZeRO-3 gathers run over the whole world and deadlock inside a stage (measured on gloo)
            raise SpecError("parallelism.zero_stage", "must be 1 or 2 with pipeline stages (a stage holds only its "
                                                      "own layers; ZeRO-3 inside a stage is not supported)")
        if self.stage_size % self.expert_parallel_size:
            raise SpecError("parallelism.expert_parallel_size",
                            "must divide parallelism.num_workers" if self.pipeline_parallel_size == 1 else
                            f"must divide the {self.stage_size} workers of a pipeline stage")

    def check_model(self, routed_experts: int | None, layers: int | None, stage_block: int = 1) -> None:
        """The rules between the sizes and the model (its config.json's routed experts and decoder layers, which
        stages split in whole blocks of `stage_block`); the control plane's at submission and the driver's before
        any worker starts (api.families.check_model_spec)."""
        if routed_experts and routed_experts % self.expert_parallel_size:
            raise SpecError("parallelism.expert_parallel_size", f"must divide the model's {routed_experts} routed "
                                                                f"experts (got {self.expert_parallel_size})")
        blocks = -(-layers // stage_block) if layers else 0
        if blocks and self.pipeline_parallel_size > blocks:
            whole = "decoder layers" if stage_block == 1 else f"blocks of {stage_block} decoder layers (of {layers})"
            raise SpecError("parallelism.pipeline_parallel_size", f"must be at most the model's {blocks} {whole}, "
                                                                  f"a stage holding whole ones (got "
                                                                  f"{self.pipeline_parallel_size})")

    def check_sequence(self, seq_len: int) -> None:
        """Context parallelism cuts each row into context_parallel_size equal contiguous slices, in rank order
        (workers.families.context: KDA's state passes from slice to slice, as fla's CP does)."""
        cp = self.context_parallel_size
        if cp > 1 and seq_len % cp:
            raise SpecError("training.seq_len", f"must be a multiple of context_parallel_size = {cp}")

    # -------------------------------------------------------------- derived sizes

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return self.num_workers // self.pipeline_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Replicas of a stage that see different examples."""
        return self.stage_size // self.context_parallel_size

    @property
    def expert_group_name(self) -> str:
        return expert_group_name(self.expert_parallel_size)

    @property
    def collective_forward(self) -> bool:
        """Whether a forward itself runs collectives (expert all-to-all, ZeRO-3 parameter gathers): every rank must
        then run each forward with its peers."""
        return self.expert_parallel_size > 1 or self.zero_stage == 3

    def worker_resources(self) -> dict[str, float]:
        """The Ray resources of one training worker (its placement bundle): the driver asks Ray Train for these,
        the scheduler checks the cluster has them before it submits."""
        return {"CPU": 1, "GPU": self.gpus_per_worker} if self.gpus_per_worker else {"CPU": 1}

    # -------------------------------------------------------------- one rank

    def coordinates(self, world_rank: int) -> Coordinates:
        stage, within = divmod(world_rank, self.stage_size)
        data_rank, context_rank = divmod(within, self.context_parallel_size)
        expert_group, ep_rank = divmod(within, self.expert_parallel_size)
        return Coordinates(world_rank, stage, data_rank, context_rank, ep_rank, expert_group)

    def expert_group_ranks(self, world_rank: int) -> list[int]:
        """The world ranks of `world_rank`'s expert-parallel group."""
        first = world_rank - self.coordinates(world_rank).ep_rank
        return list(range(first, first + self.expert_parallel_size))

    def stage_ranks(self, world_rank: int) -> list[int]:
        """The world ranks of `world_rank`'s pipeline stage (ZeRO partitions and reduces the stage's parameters
        over them)."""
        first = self.coordinates(world_rank).stage * self.stage_size
        return list(range(first, first + self.stage_size))

    @property
    def stage_first_ranks(self) -> tuple[int, ...]:
        """Each pipeline stage's first world rank, stage by stage (the writer of what its stage alone holds)."""
        return tuple(range(0, self.num_workers, self.stage_size))

    def pipeline_ranks(self, world_rank: int) -> list[int]:
        """The world ranks in the same place of every pipeline stage as `world_rank`, stage by stage: one
        micro-batch's path through the model."""
        within = world_rank % self.stage_size
        return [stage * self.stage_size + within for stage in range(self.pipeline_parallel_size)]

    def context_group_ranks(self, world_rank: int) -> list[int]:
        """The world ranks that share `world_rank`'s sequences, one contiguous slice each, in slice order."""
        first = world_rank - self.coordinates(world_rank).context_rank
        return list(range(first, first + self.context_parallel_size))

    def expert_replica_ranks(self, world_rank: int) -> list[int]:
        """The world ranks of its stage that hold the same experts as `world_rank`."""
        where = self.coordinates(world_rank)
        first = where.stage * self.stage_size + where.ep_rank
        return list(range(first, first + self.stage_size, self.expert_parallel_size))
