"""Which examples each rank trains on, step by step: one endless stream of per-epoch shuffles, cut into global
batches, each rank taking its own slice; and the validation set shared out so that every rank runs the same
number of batches."""

from __future__ import annotations

import math
import random


def steps_per_epoch(n_examples: int, global_batch_size: int) -> int:
    return math.ceil(n_examples / global_batch_size)


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


def step_examples(n_examples: int, step: int, global_batch_size: int, rank: int, world: int, seed: int) -> list[int]:
    """Example indices this rank trains on in optimizer step `step` (0-based).

    The data is one endless stream of per-epoch shuffles; step s takes the next global batch
    from it and rank r takes the r-th equal slice, so ranks never share an example in a step.
    """
    per_rank = global_batch_size // world
    first = step * global_batch_size + rank * per_rank
    orders: dict[int, list[int]] = {}
    picked = []
    for pos in range(first, first + per_rank):
        epoch = pos // n_examples
        if epoch not in orders:
            orders[epoch] = _epoch_order(n_examples, seed, epoch)
        picked.append(orders[epoch][pos % n_examples])
    return picked


def step_rng_seed(seed: int, step: int, rank: int) -> int:
    """The torch RNG seed of one rank's optimizer step: dropout masks then depend on (seed, step, rank) only,
    so a step repeated after a resume draws the same masks."""
    return random.Random(f"{seed}/{step}/{rank}").getrandbits(63)


def step_micro_batches(
    n_examples: int, step: int, global_batch_size: int, micro_batch_size: int, rank: int, world: int, seed: int
) -> list[list[int]]:
    """This rank's examples of step `step` cut into micro-batches of `micro_batch_size`."""
    picked = step_examples(n_examples, step, global_batch_size, rank, world, seed)
    return [picked[i : i + micro_batch_size] for i in range(0, len(picked), micro_batch_size)]


def eval_micro_batches(n_examples: int, micro_batch_size: int, rank: int, world: int) -> list[list[int]]:
    """This rank's share of the validation set, in the same number of batches on every rank.

    Equal counts matter: under ZeRO-3 every forward is a collective. Missing slots are None.
    """
    shard = list(range(rank, n_examples, world))
    n_batches = math.ceil(math.ceil(n_examples / world) / micro_batch_size)
    shard += [None] * (n_batches * micro_batch_size - len(shard))
    return [shard[i : i + micro_batch_size] for i in range(0, len(shard), micro_batch_size)]
