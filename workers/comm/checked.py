"""Every collective the workers run themselves (token all-to-all, expert-LoRA gathers, metric and loop reductions)
goes through these wrappers (DeepSpeed's own are held to the ranks' agreement by `lockstep`), which hold every backend to NCCL's rules, so that the CPU suite (gloo) fails where the
first GPU job would:
- tensors on the process group's device: NCCL has no CPU tensors ("No backend type associated with device type
  cpu"), while gloo takes CPU tensors only;
- contiguous inputs and outputs: NCCL reads and writes raw dense bytes (a strided receive buffer gets them as if it
  were contiguous), while gloo copies into strided outputs correctly;
- the same collective with matching dtypes and shapes on every rank (and all-to-all splits that pair up): NCCL hangs
  until its watchdog on a mismatch. On gloo the ranks first trade a small signature of the call and every rank
  raises CollectiveMismatch, naming what each rank was about to run, instead of hanging or mixing bytes. (NCCL
  groups skip the trade: it would cost a round trip per collective on the GPU path.)
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from moetune.workers.comm.local_exchange import LocalExchange

_BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}
_LOCAL_EXCHANGES: dict = {}  # process group -> LocalExchange, or None where torch.distributed's is used


class CollectiveMismatch(RuntimeError):
    """Ranks of one group were about to run different collectives, or the same one on different tensors."""


def comm_device_type(group=None) -> str:
    """The device type the tensors of a collective over `group` must live on."""
    backend = str(dist.get_backend(group)).lower()
    if backend not in _BACKEND_DEVICE:
        raise RuntimeError(f"no tensor device known for the {backend!r} process-group backend")
    return _BACKEND_DEVICE[backend]


def check_on_comm_device(tensors, group=None, what: str = "collective") -> None:
    if problem := _off_device(tensors, group, what):
        raise RuntimeError(problem)


def _off_device(tensors, group, what: str) -> str | None:
    want = comm_device_type(group)
    for t in tensors:
        if t is not None and t.device.type != want:
            return (f"{what}: a {t.device.type} tensor on a {dist.get_backend(group)} process group (its tensors "
                    f"must be on {want})")
    return None


def _local_problem(what: str, tensors, group) -> str | None:
    """This rank's side of NCCL's rules: every tensor on the group's device and contiguous."""
    if problem := _off_device(tensors, group, what):
        return problem
    for t in tensors:
        if t is not None and not t.is_contiguous():
            return (f"{what}: a non-contiguous tensor of shape {tuple(t.shape)}, strides {t.stride()} (NCCL reads "
                    "and writes dense bytes: make it contiguous, or allocate it so)")
    return None


def _describe(t: torch.Tensor, rows: str | None = None) -> str:
    shape = [rows, *t.shape[1:]] if rows is not None else list(t.shape)
    return f"{str(t.dtype).removeprefix('torch.')}{shape}"


def _checked(what: str, description: str, group, problem: str | None = None,
             splits: tuple[list[int], list[int]] | None = None) -> None:
    """Raises on every rank of `group` when this rank's tensors break NCCL's rules (`problem`) or, on gloo groups,
    when any rank's do, or the ranks are about to run different collectives or the same one on tensors that do
    not match, or all-to-all splits that do not pair up (what rank i sends to j is what j expects from i). On gloo
    a collective of its own, which every rank runs."""
    if str(dist.get_backend(group)).lower() != "gloo":
        if problem:
            raise RuntimeError(problem)
        return
    world = dist.get_world_size(group)
    sent, expected = splits if splits is not None else ([0] * world, [0] * world)
    mine = torch.tensor([zlib.crc32(f"{what}:{description}".encode()), problem is not None, *sent, *expected],
                        dtype=torch.int64, device="cpu")  # gloo's device
    table = _all_rows(mine, group).view(world, -1)  # [rank, 2 + 2·world]
    same_call = bool((table[:, 0] == table[0, 0]).all())
    pairs_up = torch.equal(table[:, 2:2 + world], table[:, 2 + world:].T)
    if same_call and pairs_up and not table[:, 1].any():
        return
    described = [None] * world
    dist.all_gather_object(described, problem or f"{what}({description})" + (
        f" sends {sent}, expects {expected}" if splits is not None else ""), group=group)
    if problem:
        raise RuntimeError(problem)
    why = ("a rank's tensors break NCCL's rules" if table[:, 1].any() else
           "different collectives or tensors" if not same_call else "splits that do not pair up")
    raise CollectiveMismatch(f"ranks of a {world}-rank group ran {why} (NCCL would hang or fail): "
                             + "; ".join(f"rank {i}: {d}" for i, d in enumerate(described)))


def _all_rows(row: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `row`, in rank order, over the group's same-host exchange where it has one (a quarter of gloo's
    latency: see local_exchange)."""
    local = _local_exchange(group)
    if local is None:
        every = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, row, group=group)
        return torch.cat(every)
    out = row.new_empty(row.numel() * dist.get_world_size(group))
    local.all_to_all_single(out, row.repeat(dist.get_world_size(group)), None, None)
    return out


def agree(what: str, description: str, group=None) -> None:
    """Raises CollectiveMismatch on every rank of a gloo `group` unless all its ranks are at the same `what` and
    `description` (for work that runs collectives this module does not see, such as DeepSpeed's); nothing on NCCL."""
    _checked(what, description, group)


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, out_splits=None, in_splits=None, group=None) -> None:
    world = dist.get_world_size(group)
    sent = list(in_splits) if in_splits is not None else [x.shape[0] // world] * world
    expected = list(out_splits) if out_splits is not None else [out.shape[0] // world] * world
    problem = _local_problem("all_to_all_single", (out, x), group)
    if problem is None and (sum(sent) != x.shape[0] or sum(expected) != out.shape[0] or out.dtype != x.dtype
                            or out.shape[1:] != x.shape[1:]):
        problem = (f"all_to_all_single: input {_describe(x)} split {sent}, output {_describe(out)} split "
                   f"{expected} do not match")
    _checked("all_to_all_single", _describe(x, "*"), group, problem, (sent, expected))
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
    _checked("all_reduce", f"{_describe(t)} {str(op).rpartition('.')[2].lower()}", group, _local_problem("all_reduce", (t,), group))
    dist.all_reduce(t, op=op, group=group)


def all_gather(out: torch.Tensor, t: torch.Tensor, group=None) -> None:
    """out[i] = rank i's `t`; `out` (world, *t.shape), dense, so that each rank's part is a dense slice of it."""
    problem = _local_problem("all_gather", (out, t), group)
    if problem is None and (out.dtype != t.dtype or out.shape != (dist.get_world_size(group), *t.shape)):
        problem = f"all_gather: output {_describe(out)} for a {_describe(t)} tensor"
    _checked("all_gather", _describe(t), group, problem)
    dist.all_gather(list(out.unbind(0)), t, group=group)


def gather(t: torch.Tensor, parts: list | None, dst: int, group=None) -> None:
    """`parts` on `dst` (a global rank) only: one tensor per rank of `group`, each like `t`."""
    problem = _local_problem("gather", (t, *(parts or ())), group)
    if problem is None and any(p.dtype != t.dtype or p.shape != t.shape for p in parts or ()):
        problem = f"gather: receive buffers {[_describe(p) for p in parts]} for a {_describe(t)} tensor"
    _checked("gather", f"{_describe(t)} to {dst}", group, problem)
    dist.gather(t, parts, dst=dst, group=group)


def barrier(group=None) -> None:
    _checked("barrier", "", group)
    dist.barrier(group=group)
