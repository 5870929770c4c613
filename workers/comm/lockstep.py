"""Ranks that run different ZeRO-3 modules fail at once on gloo, naming the modules, instead of leaving a peer
waiting in a weight gather.

Under ZeRO-3 each module holding partitioned weights gathers them with a collective before it runs (DeepSpeed's
forward pre-hook), so every rank must run those modules in the same order: a vision tower run on the ranks whose
micro-batch has images only, or an expert run only where it got tokens, leaves the others waiting (NCCL hangs until
its watchdog; gloo fails later with "Received data size doesn't match expected size", or mixes bytes when the sizes
happen to agree). On gloo groups a pre-hook placed ahead of DeepSpeed's trades the module's name among the ranks
first (comm.checked.agree). NCCL groups get no hook: it would cost a round trip per module on the GPU path.
"""

from __future__ import annotations

import torch.distributed as dist

from moetune.workers.comm import checked


def hold_in_lockstep(named_modules, group=None) -> int:
    """Hooks each (name, module) of `named_modules` (those with weights that ZeRO-3 gathers, at or below them) on a
    gloo `group`; returns how many were hooked."""
    if str(dist.get_backend(group)).lower() != "gloo":
        return 0
    hooked = 0
    for name, module in named_modules:
        module.register_forward_pre_hook(_agreeing(name, group), prepend=True)
        hooked += 1
    return hooked


def _agreeing(name: str, group):
    def hook(module, args):
        checked.agree("forward of the ZeRO-3 module", name, group)

    return hook
