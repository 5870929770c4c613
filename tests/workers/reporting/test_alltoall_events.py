"""The all-to-all timing of a MoE layer stays bounded when nothing drains it (a session never ends a step): the
exchanges' event pairs are folded into the seconds as they complete, and at most MAX_PENDING wait unresolved.

The CPU cannot make CUDA events; the exchanges here run the same accounting with host events, and with host events
that complete only when waited for (a GPU far behind the host, the worst case for the pile-up).

Sabotage noted: without the MAX_PENDING bound in `_fold`, the lagging case holds all 1,000 pairs and fails."""

import torch

from moetune.workers.comm.exchange_stats import MAX_PENDING, ExchangeStats, HostEvent

EXCHANGES = 1000
ROWS = torch.zeros(6, 8)  # 6 tokens of 32 bytes
SPLITS = [2, 4]  # this rank (0) keeps 2, sends 4


class LaggingEvent(HostEvent):
    """Complete only once waited for."""

    waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def _exchanges(stats: ExchangeStats) -> list[int]:
    pending = []
    for _ in range(EXCHANGES):
        with stats.timed(ROWS, SPLITS, 0):
            pass
        pending.append(len(stats._pending))
    return pending


def test_completed_exchanges_are_folded_at_once():
    stats = ExchangeStats()
    assert max(_exchanges(stats)) == 0
    sent, seconds = stats.drain()
    assert sent == EXCHANGES * 4 * 32 and seconds > 0


def test_exchanges_the_device_has_not_finished_stay_bounded_and_each_counts_once():
    made = []

    def events(x):
        made.append((LaggingEvent(), LaggingEvent()))
        return made[-1]

    stats = ExchangeStats(events)
    pending = _exchanges(stats)
    assert max(pending) == MAX_PENDING and pending[-1] == MAX_PENDING
    folded = stats.seconds
    assert folded == sum(s.elapsed_time(e) / 1000 for s, e in made[: EXCHANGES - MAX_PENDING])
    sent, seconds = stats.drain()
    assert not stats._pending and sent == EXCHANGES * 4 * 32
    assert seconds == folded + sum(s.elapsed_time(e) / 1000 for s, e in made[EXCHANGES - MAX_PENDING:])
    assert stats.drain() == (0, 0.0)
