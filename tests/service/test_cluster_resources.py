"""Placement decisions from a cluster's per-node totals and usage (the shape of Ray's /api/cluster_status)."""

from moetune.api.models.parallelism import ParallelDims
from moetune.service.cluster.resources import NodeResources, never_placeable, nodes_from_cluster_status, wait_reason

CPU_NODE = NodeResources(total={"CPU": 4.0, "memory": 1e10}, used={"CPU": 0.0})


def test_cluster_status_gives_each_nodes_total_and_use():
    status = {"clusterStatus": {"loadMetricsReport": {"usageByNode": {
        "n1": {"CPU": [1.0, 4.0], "GPU": [0.0, 8.0]}, "n2": {"CPU": [0.0, 2.0]}}}}}
    nodes = nodes_from_cluster_status(status)
    assert [n.total for n in nodes] == [{"CPU": 4.0, "GPU": 8.0}, {"CPU": 2.0}]
    assert nodes[0].free() == {"CPU": 3.0, "GPU": 8.0}
    assert nodes_from_cluster_status({"clusterStatus": None}) == []  # the head has not reported yet


def test_gpus_no_node_has_are_named():
    shortage = never_placeable(ParallelDims(num_workers=1, gpus_per_worker=8), [CPU_NODE])
    assert shortage.param == "parallelism.gpus_per_worker"
    assert "each worker needs 1 CPU + 8 GPU, but no node of the Ray cluster has more than 0 GPU" in shortage.message


def test_more_workers_than_all_nodes_hold_are_named():
    nodes = [CPU_NODE, NodeResources(total={"CPU": 2.5}, used={})]
    shortage = never_placeable(ParallelDims(num_workers=1000), nodes)
    assert shortage.param == "parallelism.num_workers"
    assert "1000 workers need 1000 CPU" in shortage.message and "at most 6 such workers" in shortage.message
    assert never_placeable(ParallelDims(num_workers=6), nodes) is None  # 4 + 2 (half a CPU holds no worker)


def test_gpu_workers_fit_node_by_node():
    gpu_nodes = [NodeResources(total={"CPU": 16.0, "GPU": 8.0}, used={}) for _ in range(2)]
    assert never_placeable(ParallelDims(num_workers=16, gpus_per_worker=1), gpu_nodes) is None
    assert never_placeable(ParallelDims(num_workers=3, gpus_per_worker=6), gpu_nodes).param == \
        "parallelism.num_workers"  # 12 GPUs in all, but one 6-GPU worker per node


def test_a_busy_cluster_is_a_wait_with_its_reason():
    par = ParallelDims(num_workers=2)
    busy = NodeResources(total={"CPU": 4.0}, used={"CPU": 3.0})
    assert wait_reason(par, [busy], held={}) == ("waiting for cluster resources: 2 workers need 2 CPU, "
                                                 "1 CPU free now")
    assert wait_reason(par, [CPU_NODE], held={}) is None
    # this control plane's running jobs count before Ray's usage report shows them
    assert "0 CPU free now" in wait_reason(par, [CPU_NODE], held={"CPU": 4.0})
