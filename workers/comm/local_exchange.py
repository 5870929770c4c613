"""The token all-to-all of a gloo (CPU) process group whose ranks share one host, over Unix sockets between them.

gloo hands every collective to a worker thread and its I/O thread, and back: measured with two ranks on one 2-core
host, its all-to-all takes 230-270 µs for 8 integers and 630 µs for 512 KiB, and an EP layer makes five per step
(the count exchange, two token exchanges forward, two backward). Over a Unix socket pair per two ranks, sent and
received from the calling thread, the same exchanges take 62 and 104 µs. NCCL groups, and groups whose ranks are
not all in this host's network namespace (abstract socket names live in one), keep torch.distributed's.
"""

from __future__ import annotations

import math
import os
import selectors
import socket
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

_HELLO = 4  # bytes of the rank number a connecting peer sends first
_TIMEOUT = timedelta(minutes=30)  # torch.distributed's default for gloo collectives


def _host_key() -> tuple[str, int]:
    """The same on ranks that can reach each other's abstract Unix sockets: this boot of this machine, and this
    network namespace."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip(), os.stat("/proc/self/ns/net").st_ino


class LocalExchange:
    """Connected Unix sockets to every other rank of `group` (made collectively by `connect`)."""

    def __init__(self, me: int, peers: dict[int, socket.socket]):
        self.me, self.peers = me, peers
        self.selector = selectors.DefaultSelector()
        for sock in peers.values():
            sock.setblocking(False)

    @classmethod
    def connect(cls, group) -> LocalExchange | None:
        """Collective over `group`: the exchange, or None where some rank is on another host or namespace."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            name = f"\0moetune-ep-{uuid.uuid4().hex}"
            listener.bind(name)
            listener.listen()
            # also the barrier: once it returns, every rank listens
            ranks = [None] * dist.get_world_size(group)
            dist.all_gather_object(ranks, (_host_key(), name), group=group)
            if len({key for key, _ in ranks}) > 1:
                return None
            me, peers = dist.get_rank(group), {}
            for peer in range(me + 1, len(ranks)):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(ranks[peer][1])
                sock.sendall(me.to_bytes(_HELLO, "little"))
                peers[peer] = sock
            for _ in range(me):
                sock, _ = listener.accept()
                peers[int.from_bytes(_recv_exactly(sock, _HELLO), "little")] = sock
        finally:
            listener.close()
        return cls(me, peers)

    def all_to_all_single(self, out: torch.Tensor, x: torch.Tensor, out_splits=None, in_splits=None) -> None:
        """dist.all_to_all_single's contract for contiguous CPU tensors: rows of `x` split by `in_splits` (equal
        parts when None) go to the ranks in order, `out` receives `out_splits` rows from each."""
        size = len(self.peers) + 1
        in_splits = in_splits or [x.shape[0] // size] * size
        out_splits = out_splits or [out.shape[0] // size] * size
        row = math.prod(x.shape[1:]) * x.element_size()  # also when x has no row
        sent, received = _bytes(x), _bytes(out)
        sends, receives = {}, {}
        start_in = start_out = 0
        for peer in range(size):
            send = sent[start_in * row:(start_in + in_splits[peer]) * row]
            receive = received[start_out * row:(start_out + out_splits[peer]) * row]
            if peer == self.me:
                receive[:] = send
            else:
                if len(send):
                    sends[peer] = send
                if len(receive):
                    receives[peer] = receive
            start_in, start_out = start_in + in_splits[peer], start_out + out_splits[peer]
        self._move(sends, receives)

    def _move(self, sends: dict, receives: dict) -> None:
        """Writes and reads every peer's bytes as the sockets take them (a peer's send blocks while its receive
        buffer is full, so neither side may finish its sends before it reads)."""
        while True:
            for peer, view in list(sends.items()):
                sends[peer] = view[self._moved(peer, self.peers[peer].send, view):]
                if not len(sends[peer]):
                    del sends[peer]
            for peer, view in list(receives.items()):
                receives[peer] = view[self._moved(peer, self.peers[peer].recv_into, view):]
                if not len(receives[peer]):
                    del receives[peer]
            if not sends and not receives:
                return
            self._wait(sends, receives)

    @staticmethod
    def _moved(peer: int, io, view) -> int:
        """Bytes `io` sent or received without blocking (0 where the socket had no room or nothing yet)."""
        try:
            moved = io(view)
        except BlockingIOError:
            return 0
        except ConnectionError:
            moved = 0
        if moved == 0:  # a receive's end of stream; a send or receive on a connection the peer reset
            raise RuntimeError(f"expert all-to-all: EP rank {peer} closed its connection (it stopped)")
        return moved

    def _wait(self, sends: dict, receives: dict) -> None:
        for peer in sends.keys() | receives.keys():
            events = (selectors.EVENT_WRITE if peer in sends else 0) | (selectors.EVENT_READ if peer in receives else 0)
            self.selector.register(self.peers[peer], events)
        try:
            if not self.selector.select(_TIMEOUT.total_seconds()):
                raise RuntimeError(f"expert all-to-all: no progress in {_TIMEOUT} (EP ranks "
                                   f"{sorted(sends.keys() | receives.keys())})")
        finally:
            for peer in sends.keys() | receives.keys():
                self.selector.unregister(self.peers[peer])


def _bytes(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous():  # a reshaped copy would take the received bytes instead of `t`
        raise ValueError("expert all-to-all: tensors must be contiguous")
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy())


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise RuntimeError("expert all-to-all: a peer closed its connection while connecting")
        data += chunk
    return data
