"""The LoRA weights as save_weights left them, by name: what a sample naming those weights (Tinker's sampler, a
snapshot taken by save_weights_for_sampler) draws from after later steps changed the current ones. Held in the
group's memory, the newest few; a name no longer held, or under ZeRO-3 (each rank holds a slice of every weight)
one whose weights changed since, is refused rather than answered from the current weights."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch

from moetune.workers.engine.deepspeed import partitioned

HELD = 8  # the newest saves kept: a sampler is mostly used for the step it was saved at


def _trainable(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class WeightSnapshots:
    def __init__(self):
        self.version = 0  # counts the changes of the weights (steps, loads)
        self.held: OrderedDict[str, tuple[int, dict[str, torch.Tensor] | None]] = OrderedDict()

    def weights_changed(self) -> None:
        self.version += 1

    def keep(self, name: str, model) -> None:
        params = _trainable(model)
        copies = None if any(partitioned(p) for p in params.values()) else \
            {n: p.detach().clone() for n, p in params.items()}
        self.held[name] = (self.version, copies)
        self.held.move_to_end(name)
        while len(self.held) > HELD:
            self.held.popitem(last=False)

    @contextmanager
    def swapped_in(self, name: str, model):
        """The weights saved as `name` in the model for the block (the current ones back after it). KeyError with
        the reason when they are not held."""
        if name not in self.held:
            raise KeyError(f"the weights saved as {name!r} are not held by this session's worker group (it keeps the "
                           f"{HELD} newest saves since it started): save them again")
        version, copies = self.held[name]
        if version == self.version:  # nothing changed since the save: the current weights are those
            yield
            return
        if copies is None:
            raise KeyError(f"the weights saved as {name!r} changed since (ZeRO-3 keeps no copy): a sampler is only "
                           f"usable until the next optim_step or load_state under ZeRO-3")
        params = _trainable(model)
        current = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(copies[n])
            try:
                yield
            finally:
                for n, p in params.items():
                    p.copy_(current[n])
