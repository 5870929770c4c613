"""The one parallel layout type (api.models.parallelism.ParallelDims): its rules name the field, and each rank's
coordinates and groups follow one rank order (pipeline stage, data index, context index; EP blocks within a stage),
the order DeepSpeed makes its expert groups in (workers.engine.experts.expert_groups checks DeepSpeed's own groups
against these at every expert-parallel start)."""

from __future__ import annotations

import pytest

from moetune.api.models.base import SpecError
from moetune.api.models.parallelism import ParallelDims


def _refused(check, param: str, words: str) -> None:
    with pytest.raises(SpecError) as refused:
        check()
    assert refused.value.param == param and words in refused.value.message, refused.value.message


@pytest.mark.parametrize("dims, param, words", [
    (dict(num_workers=6, expert_parallel_size=4), "parallelism.expert_parallel_size", "must divide"),
    (dict(num_workers=3, context_parallel_size=2), "parallelism.num_workers", "context_parallel_size = 2"),
    (dict(num_workers=2, gpus_per_worker=4), "parallelism.gpus_per_worker", "num_workers: 8"),
    (dict(num_workers=2, pipeline_parallel_size=2, zero_stage=3), "parallelism.zero_stage", "1 or 2"),
])
def test_a_layout_that_cannot_run_on_its_workers_names_the_field(dims, param, words):
    _refused(ParallelDims(**dims).check_world, param, words)


def test_pipeline_stages_keep_a_family_s_blocks_whole():
    """Kimi K3's 93 layers in Attention-Residual blocks of 12: 8 blocks, so at most 8 stages."""
    ParallelDims(num_workers=8, pipeline_parallel_size=8).check_model(896, 93, 12)
    _refused(lambda: ParallelDims(num_workers=9, pipeline_parallel_size=9).check_model(896, 93, 12),
             "parallelism.pipeline_parallel_size", "8 blocks of 12 decoder layers (of 93)")


def test_a_layout_that_cannot_divide_the_model_names_the_field():
    _refused(lambda: ParallelDims(num_workers=6, expert_parallel_size=3).check_model(8, 4),
             "parallelism.expert_parallel_size", "the model's 8 routed experts")
    _refused(lambda: ParallelDims(num_workers=8, pipeline_parallel_size=8).check_model(8, 4),
             "parallelism.pipeline_parallel_size", "the model's 4 decoder layers")
    _refused(lambda: ParallelDims(num_workers=4, context_parallel_size=2).check_sequence(101),
             "training.seq_len", "multiple of context_parallel_size = 2")
    ParallelDims(num_workers=4, context_parallel_size=2).check_sequence(102)
    ParallelDims(num_workers=8, expert_parallel_size=4, pipeline_parallel_size=2).check_model(8, 4)


def test_each_rank_has_one_place_and_its_groups_tile_the_world():
    dims = ParallelDims(num_workers=16, expert_parallel_size=4, context_parallel_size=2, pipeline_parallel_size=2)
    places = [dims.coordinates(r) for r in range(16)]
    assert len({(p.stage, p.data_rank, p.context_rank) for p in places}) == 16  # one rank per mesh point
    assert [p.stage for p in places] == [0] * 8 + [1] * 8
    assert [p.context_rank for p in places[:4]] == [0, 1, 0, 1] and dims.data_parallel_size == 4
    assert dims.expert_group_ranks(5) == [4, 5, 6, 7] and places[5].ep_rank == 1
    assert dims.expert_replica_ranks(5) == [1, 5] and dims.expert_replica_ranks(13) == [9, 13]
    assert dims.context_group_ranks(5) == [4, 5] and dims.context_group_ranks(12) == [12, 13]
    for world_rank in range(16):  # every EP, replica and CP group holds its own rank, within its stage
        for group in (dims.expert_group_ranks(world_rank), dims.expert_replica_ranks(world_rank),
                      dims.context_group_ranks(world_rank)):
            assert world_rank in group and {dims.coordinates(r).stage for r in group} == {places[world_rank].stage}
    assert dims.stage_ranks(5) == list(range(8)) and dims.stage_ranks(12) == list(range(8, 16))
    assert dims.pipeline_ranks(5) == [5, 13] and dims.pipeline_ranks(13) == [5, 13]
    for world_rank in range(16):  # a pipeline holds its rank once per stage, at the same place in each
        pipeline = dims.pipeline_ranks(world_rank)
        assert world_rank in pipeline and [dims.coordinates(r).stage for r in pipeline] == [0, 1]
        assert len({(places[r].data_rank, places[r].context_rank, places[r].ep_rank) for r in pipeline}) == 1
    assert dims.expert_group_name == "ep_size_4"


def test_context_parallelism_is_refused_for_a_family_without_its_path():
    from moetune.api.families import check_model_spec
    from moetune.api.models.lora import LoraSpec

    dims = ParallelDims(num_workers=2, context_parallel_size=2)
    _refused(lambda: check_model_spec({"model_type": "qwen3_moe", "num_experts": 8, "num_hidden_layers": 2},
                                      LoraSpec(), dims),
             "parallelism.context_parallel_size",
             "the families that have one: deepseek_v3, glm5_next, kimi_k25, kimi_k3, kimi_linear")
    check_model_spec({"model_type": "kimi_k3", "text_config": {"num_experts": 8, "num_hidden_layers": 4}},
                     LoraSpec(), dims)


def test_pipeline_stages_are_refused_for_a_family_without_a_stage_split_and_keep_k3_s_blocks_whole():
    from moetune.api.families import check_model_spec
    from moetune.api.models.lora import LoraSpec

    dims = ParallelDims(num_workers=2, pipeline_parallel_size=2)
    _refused(lambda: check_model_spec({"model_type": "deepseek_v3", "n_routed_experts": 8, "num_hidden_layers": 2},
                                      LoraSpec(), dims),
             "parallelism.pipeline_parallel_size", "the families that have one: kimi_k3, kimi_linear, qwen3_moe")
    k3 = {"model_type": "kimi_k3", "text_config": {"num_experts": 8, "num_hidden_layers": 4, "attn_res_block_size": 2}}
    check_model_spec(k3, LoraSpec(), dims)
    _refused(lambda: check_model_spec(k3, LoraSpec(), ParallelDims(num_workers=4, pipeline_parallel_size=4)),
             "parallelism.pipeline_parallel_size", "the model's 2 blocks of 2 decoder layers")
