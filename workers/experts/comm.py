"""Every collective the workers run themselves (token all-to-all, expert-LoRA gathers, metric and loop reductions)
goes through these wrappers, which refuse a tensor that is not on the process group's device: NCCL has no CPU
tensors ("No backend type associated with device type cpu"), while gloo takes CPU tensors only. Without the check a
CPU tensor passes the CPU suite (gloo) and crashes the first GPU job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetune.workers.experts.local_exchange import LocalExchange

_BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}
_LOCAL_EXCHANGES: dict = {}  # process group -> LocalExchange, or None where torch.distributed's is used


def comm_device_type(group=None) -> str:
    """The device type the tensors of a collective over `group` must live on."""
    backend = str(dist.get_backend(group)).lower()
    if backend not in _BACKEND_DEVICE:
        raise RuntimeError(f"no tensor device known for the {backend!r} process-group backend")
    return _BACKEND_DEVICE[backend]


def check_on_comm_device(tensors, group=None, what: str = "collective") -> None:
    want = comm_device_type(group)
    for t in tensors:
        if t is not None and t.device.type != want:
            raise RuntimeError(f"{what}: a {t.device.type} tensor on a {dist.get_backend(group)} process group "
                               f"(its tensors must be on {want})")


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, out_splits=None, in_splits=None, group=None) -> None:
    check_on_comm_device((out, x), group, "all_to_all_single")
    local = _local_exchange(group)
    if local is None:
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    else:
        local.all_to_all_single(out, x, out_splits, in_splits)


def _local_exchange(group) -> LocalExchange | None:
    """The group's same-host exchange for gloo groups (made by the group's first all-to-all, which every rank of it
    calls at the same point), None for other backends."""
    key = group or dist.group.WORLD
    if key not in _LOCAL_EXCHANGES:
        gloo = str(dist.get_backend(group)).lower() == "gloo"
        _LOCAL_EXCHANGES[key] = LocalExchange.connect(group) if gloo else None
    return _LOCAL_EXCHANGES[key]


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    check_on_comm_device((t,), group, "all_reduce")
    dist.all_reduce(t, op=op, group=group)


def gather(t: torch.Tensor, parts: list | None, dst: int, group=None) -> None:
    check_on_comm_device((t, *(parts or ())), group, "gather")
    dist.gather(t, parts, dst=dst, group=group)


def barrier(group=None) -> None:
    dist.barrier(group=group)
