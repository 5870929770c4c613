"""comm.local_exchange: the same-host all-to-all of gloo groups moves exactly what gloo's own moves (uneven and
empty splits, payloads larger than a socket buffer, several dtypes), falls back to gloo where a rank is in another
network namespace, and fails with a message, not a hang, when a rank stops. Three real processes on loopback."""

import os
import re

import pytest
import torch
import torch.distributed as dist

from bench.support.harness import launch
from moetune.workers.comm import checked, local_exchange
from moetune.workers.comm.local_exchange import LocalExchange

WORLD = 3


def _exchanges(rank: int, world: int, out_dir: str) -> None:
    """Random split matrices (zeros included) through comm's all-to-all and through gloo's: equal bytes."""
    generator = torch.Generator().manual_seed(7)
    done = 0
    for rows_max, width, dtype in ((5, 3, torch.float32), (0, 4, torch.int64), (40_000, 16, torch.bfloat16)):
        splits = torch.randint(0, rows_max + 1, (world, world), generator=generator)
        splits[0, 1] = 0  # rank 0 sends rank 1 nothing
        in_splits, out_splits = splits[rank].tolist(), splits[:, rank].tolist()
        x = (torch.randn(sum(in_splits), width, generator=torch.Generator().manual_seed(rank)) * 100).to(dtype)
        got, want = x.new_empty(sum(out_splits), width), x.new_empty(sum(out_splits), width)
        checked.all_to_all_single(got, x, out_splits, in_splits, group=dist.group.WORLD)
        dist.all_to_all_single(want, x, out_splits, in_splits)
        assert torch.equal(got, want), (rank, rows_max, dtype)
        done += 1
    equal = torch.arange(world * 2, dtype=torch.float64) + 10 * rank  # splits None: equal parts
    got, want = torch.empty_like(equal), torch.empty_like(equal)
    checked.all_to_all_single(got, equal)
    dist.all_to_all_single(want, equal)
    assert torch.equal(got, want)
    assert isinstance(checked._LOCAL_EXCHANGES[dist.group.WORLD], LocalExchange)  # gloo's was not what ran
    torch.save(done + 1, os.path.join(out_dir, f"rank{rank}.pt"))


def _other_namespace(rank: int, world: int, out_dir: str) -> None:
    """Rank 2 reports another network namespace (a mock: the suite cannot move a process out of its namespace):
    no rank connects, every rank stays on gloo."""
    if rank == 2:
        local_exchange._host_key = lambda: ("another-boot", 0)
    made = LocalExchange.connect(dist.group.WORLD)
    torch.save(made is None, os.path.join(out_dir, f"rank{rank}.pt"))


def _a_rank_stops(rank: int, world: int, out_dir: str) -> None:
    exchange = LocalExchange.connect(dist.group.WORLD)
    if rank == 2:
        for sock in exchange.peers.values():
            sock.close()  # as its process would on exit, before its part of the exchange
        return
    x = torch.ones(world, 8)
    try:
        exchange.all_to_all_single(torch.empty_like(x), x)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    torch.save(message, os.path.join(out_dir, f"rank{rank}.pt"))


def _results(tmp_path, ranks=range(WORLD)):
    return [torch.load(tmp_path / f"rank{r}.pt") for r in ranks]


def test_the_same_bytes_as_gloo(tmp_path):
    launch(_exchanges, WORLD, str(tmp_path))
    assert _results(tmp_path) == [4] * WORLD


def test_a_rank_in_another_namespace_keeps_the_group_on_gloo(tmp_path):
    launch(_other_namespace, WORLD, str(tmp_path))
    assert _results(tmp_path) == [True] * WORLD


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_an_error_not_a_hang(tmp_path):
    launch(_a_rank_stops, WORLD, str(tmp_path))
    messages = _results(tmp_path, (0, 1))
    # the first rank to notice names rank 2; the other may see that rank stop first (it exits after its error)
    assert all(re.fullmatch(r"expert all-to-all: EP rank [0-2] closed its connection \(it stopped\)", m)
               for m in messages), messages
    assert any("EP rank 2 closed" in m for m in messages), messages
