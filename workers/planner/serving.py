"""Whether a base fits the one device that serves it. Serving builds the whole base there, its routed experts at EP=1
(workers.generate.loading), so the planner's count of its frozen weights, from config.json alone, is checked
against that device's memory before a weight is read: a base that cannot fit is refused in seconds, not after a
download of its checkpoint that ends out of memory."""

from __future__ import annotations

from moetune.workers.families import family_for
from moetune.workers.model import meta_model
from moetune.workers.planner.memory import USABLE_FRACTION
from moetune.workers.planner.weights import frozen_tensors

_GIB = 2**30


class BaseTooLargeError(RuntimeError):
    """The base's weights do not fit the serving device."""


def served_base_bytes(config: dict, dtype) -> int:
    """Bytes of the base's weights on the serving device: every tensor in `dtype`, quantized ones at their stored
    size (serving keeps them quantized), every routed expert on it."""
    return sum(t.nbytes for t in frozen_tensors(meta_model(config, dtype), family_for(config), config, dtype,
                                                dequantized=False))


def refuse_unless_it_fits(config: dict, dtype, device_memory: int, base: str, device: str) -> None:
    """Raises BaseTooLargeError, naming both sizes, when the base's weights exceed the share of `device_memory` (of
    `device`, as named in the message) a plan may fill (planner.memory.USABLE_FRACTION)."""
    needed, usable = served_base_bytes(config, dtype), USABLE_FRACTION * device_memory
    if needed > usable:
        raise BaseTooLargeError(
            f"the base {base} cannot be served on {device}: its weights take {needed / _GIB:,.1f} GiB (the "
            f"planner's count from its config.json, every routed expert on the device: serving runs EP=1), over "
            f"the {usable / _GIB:,.1f} GiB a plan may fill ({USABLE_FRACTION:.0%} of its {device_memory / _GIB:,.1f} "
            "GiB); serving does not shard a base over devices yet: serve one whose weights fit this device")
