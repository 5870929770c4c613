"""A ZeRO-3 job's rank, assembled by the one builder (load partitioner, expert module, expert LoRA, loss head,
engine, MoE metrics hooks), makes every tensor where its weights live. On a GPU a tensor moetune makes on the host by
default stays there: DeepSpeed never moves a model whose frozen weights ZeRO-3 partitioned at load, so the expert
module's token counts stayed on the host and the expert-load metrics failed ("Expected all tensors to be on the same
device"). Here such tensors land on the meta device (bench.support.host_tensors), where they fail or are found."""

from tests.workers.experts.cases import BUILDER_CASES


def test_a_zero3_step_through_the_builder_leaves_no_tensor_on_the_host(ep_runs):
    (case,) = BUILDER_CASES
    _, ranks = ep_runs(case)
    for r in ranks:
        assert r["on_meta"] == [], r["on_meta"]
        assert r["layers"] > 0 and r["loss"] > 0
    # the expert-load totals were counted (a host buffer on the meta device counts nothing: imbalance 0)
    assert all(v >= 1.0 for v in ranks[0]["figures"]["expert_imbalance"].values()), ranks[0]["figures"]
