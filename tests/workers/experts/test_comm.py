"""experts.comm: the collectives refuse a tensor that is not on the process group's device (NCCL takes CUDA
tensors only, gloo CPU ones), and every collective the workers run goes through it. The gloo EP suite (this folder)
runs the expert all-to-all, the expert-LoRA gathers and the loop's reductions through the same wrappers."""

import ast
import pathlib

import pytest
import torch
import torch.distributed as dist

from moetune.workers.experts import comm

WORKERS = pathlib.Path(__file__).parents[3] / "workers"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "gather",
               "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "barrier"}


@pytest.fixture
def gloo_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_tensor_off_the_communication_device_is_refused(gloo_world):
    assert comm.comm_device_type() == "cpu"
    t = torch.ones(3)
    comm.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(RuntimeError, match="all_reduce: a meta tensor on a gloo process group"):
        comm.all_reduce(torch.ones(3, device="meta"))
    out = torch.empty(2, device="meta")
    with pytest.raises(RuntimeError, match="all_to_all_single: a meta tensor"):
        comm.all_to_all_single(out, torch.ones(2))


def test_every_collective_of_the_workers_goes_through_parallel_comm():
    direct = []
    for path in WORKERS.rglob("*.py"):
        if path.name == "comm.py" and path.parent.name == "experts":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"):
                direct.append(f"{path.relative_to(WORKERS)}:{node.lineno} dist.{node.func.attr}")
    assert not direct, direct
