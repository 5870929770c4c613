"""The saved-bytes counter (workers.planner.saved) counts every storage saved during a forward, those that die before
the next is made included (the allocator gives a dead storage's address to the next one at once)."""

import torch

from moetune.workers.planner.saved import SavedBytes


def test_storages_freed_during_the_forward_each_count():
    model = torch.nn.Linear(2, 2)  # alive while counting, as the trained model is: its storages are left out
    counter = SavedBytes(model)
    with counter.counting():
        for _ in range(50):  # each branch saves its own 1,000 floats and is dropped before the next
            x = torch.randn(1000, requires_grad=True)
            y = (x * x).sum()  # x saved twice: one storage, counted once
            del x, y
        kept = torch.randn(1000, requires_grad=True)
        loss = (kept * 2).sum() + (kept * kept).sum()  # a live storage saved by two operations: still once
    assert counter.total == 51 * 4000 and loss.requires_grad
