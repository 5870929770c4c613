"""comm.checked: the collectives hold gloo to NCCL's rules: they refuse a tensor that is not on the process group's
device (NCCL takes CUDA tensors only, gloo CPU ones) or not contiguous (NCCL writes raw dense bytes), and ranks that
run different collectives, or the same one on tensors that do not match, or different ZeRO-3 modules
(comm.lockstep), fail on every rank instead of hanging.
Every collective the workers run goes through it. The gloo EP suite (this folder) runs the expert all-to-all, the
expert-LoRA gathers and the loop's reductions through the same wrappers."""

import ast
import os
import pathlib

import pytest
import torch
import torch.distributed as dist

from bench.support.harness import launch
from moetune.workers.comm import checked
from moetune.workers.comm.lockstep import hold_in_lockstep

WORKERS = pathlib.Path(__file__).parents[3] / "workers"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "gather",
               "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "barrier"}


@pytest.fixture
def gloo_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_tensor_off_the_communication_device_is_refused(gloo_world):
    assert checked.comm_device_type() == "cpu"
    t = torch.ones(3)
    checked.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(RuntimeError, match="all_reduce: a meta tensor on a gloo process group"):
        checked.all_reduce(torch.ones(3, device="meta"))
    out = torch.empty(2, device="meta")
    with pytest.raises(RuntimeError, match="all_to_all_single: a meta tensor"):
        checked.all_to_all_single(out, torch.ones(2))


def test_every_collective_of_the_workers_goes_through_checked():
    direct = []
    for path in WORKERS.rglob("*.py"):
        if path.parent.name == "comm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"):
                direct.append(f"{path.relative_to(WORKERS)}:{node.lineno} dist.{node.func.attr}")
    assert not direct, direct


def _outcome(call) -> str:
    try:
        call()
        return "ran"
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"


def _disagreements(rank: int, world: int, out_dir: str) -> None:
    """Each case is one call per rank, every rank at the same point; an outcome per case and rank."""
    permuted = torch.arange(24.0).reshape(2, 3, 4).permute(1, 2, 0)  # dense, not contiguous (an expert-LoRA slab)
    tower, embeddings = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)  # stand-ins for modules ZeRO-3 gathers
    hold_in_lockstep([("visual", tower), ("embed_tokens", embeddings)])
    cases = {
        "strided_receive": lambda: checked.gather(permuted.contiguous(), [torch.empty_like(permuted) for _ in range(2)]
                                               if rank == 0 else None, dst=0),
        "strided_send": lambda: checked.gather(permuted, [torch.empty(3, 4, 2) for _ in range(2)] if rank == 0 else None,
                                            dst=0),
        "other_collective": lambda: checked.all_reduce(torch.ones(3)) if rank == 0 else checked.barrier(),
        "other_shape": lambda: checked.all_reduce(torch.ones(3 + rank)),
        "other_dtype": lambda: checked.all_reduce(torch.ones(3, dtype=torch.float32 if rank else torch.float64)),
        # rank 0 sends rank 1 two rows, rank 1 expects one from it
        "splits": lambda: checked.all_to_all_single(torch.empty(2 if rank == 0 else 2, 4), torch.ones(3 if rank == 0
                                                 else 2, 4), out_splits=[1, 1] if rank == 0 else [1, 1],
                                                 in_splits=[1, 2] if rank == 0 else [1, 1]),
        "other_module": lambda: (tower if rank == 0 else embeddings)(torch.ones(2)),
        "agreeing": lambda: checked.all_reduce(torch.ones(3)),
        "same_module": lambda: tower(torch.ones(2)),
    }
    torch.save({name: _outcome(call) for name, call in cases.items()}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.timeout(120)
def test_gloo_fails_where_nccl_would(tmp_path):
    launch(_disagreements, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # a receive buffer with a permuted slab's strides (what NCCL fills as if dense) is refused on the receiving rank
    # and the sending rank learns it from the same check instead of waiting in the gather
    assert ranks[0]["strided_receive"].startswith("RuntimeError: gather: a non-contiguous tensor"), ranks[0]
    assert ranks[1]["strided_receive"].startswith("CollectiveMismatch: ranks of a 2-rank group ran a rank's tensors "
                                                  "break NCCL's rules"), ranks[1]
    assert "rank 0: gather: a non-contiguous tensor of shape (3, 4, 2)" in ranks[1]["strided_receive"]
    assert all(r["strided_send"].startswith("RuntimeError: gather: a non-contiguous tensor") for r in ranks)
    for case, says in (("other_collective", "rank 0: all_reduce(float32[3] sum); rank 1: barrier()"),
                       ("other_shape", "rank 0: all_reduce(float32[3] sum); rank 1: all_reduce(float32[4] sum)"),
                       ("other_dtype", "rank 0: all_reduce(float64[3]"),
                       ("splits", "splits that do not pair up"),
                       ("other_module", "rank 0: forward of the ZeRO-3 module(visual); "
                                        "rank 1: forward of the ZeRO-3 module(embed_tokens)")):
        for r in ranks:  # every rank raises (none is left waiting in the collective), naming what each ran
            assert r[case].startswith("CollectiveMismatch: ranks of a 2-rank group ran"), (case, r[case])
            assert says in r[case], (case, r[case])
    assert [r["agreeing"] for r in ranks] == [r["same_module"] for r in ranks] == ["ran", "ran"]
