"""Where a context-parallel rank's slice sits in the unsplit row: its token range, and (with packed sequences) which
sequences it holds, which one it continues from an earlier rank and which one it hands on to the next.

The ranks split one row (B rows without packing, or one packed row with `cu_seqlens`) into contiguous slices
`bounds[r]:bounds[r + 1]`. Read by kernels.kda.context_state (the recurrent state carried across slices) and by
workers/comm's CP ops (the KDA state all-gather, the short conv's halo); the parallel layout builds one per rank."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class SliceLayout:
    """`bounds`: the R + 1 token offsets of the ranks' slices (0 first, every slice non-empty); `rank`: whose slice;
    `cu_seqlens`: the unsplit row's packed offsets on the host (None: every row is one sequence)."""

    bounds: tuple[int, ...]
    rank: int
    cu_seqlens: tuple[int, ...] | None = None

    def __post_init__(self):
        bounds = tuple(int(b) for b in self.bounds)
        if bounds[0] != 0 or any(b >= e for b, e in zip(bounds, bounds[1:])):
            raise ValueError(f"slice bounds must start at 0 and rise strictly, got {list(bounds)}")
        if not 0 <= self.rank < len(bounds) - 1:
            raise ValueError(f"rank {self.rank} outside the {len(bounds) - 1} slices")
        object.__setattr__(self, "bounds", bounds)
        if self.cu_seqlens is not None:
            cu = tuple(int(c) for c in self.cu_seqlens)
            if cu[0] != 0 or cu[-1] != bounds[-1] or any(b > e for b, e in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens {list(cu)} must rise from 0 to the row's {bounds[-1]} tokens")
            object.__setattr__(self, "cu_seqlens", cu)

    @classmethod
    def even(cls, tokens: int, world: int, rank: int, cu_seqlens=None) -> SliceLayout:
        """Equal slices of a row of `tokens` (a multiple of `world`)."""
        if tokens % world:
            raise ValueError(f"{tokens} tokens do not split into {world} equal slices")
        size = tokens // world
        return cls(tuple(range(0, tokens + 1, size)), rank, None if cu_seqlens is None else tuple(cu_seqlens))

    @property
    def world(self) -> int:
        return len(self.bounds) - 1

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def first_sequence(self) -> int:
        """Index of the slice's first (non-empty) sequence; rows are indexed by themselves without packing (0)."""
        return 0 if self.cu_seqlens is None else bisect.bisect_right(self.cu_seqlens, self.start) - 1

    @property
    def first_sequence_start(self) -> int:
        """Token offset, in the unsplit row, where the slice's first sequence begins."""
        return 0 if self.cu_seqlens is None else self.cu_seqlens[self.first_sequence]

    @property
    def local_offsets(self) -> list[int] | None:
        """The slice's own packed offsets (its first sequence cut at the slice's start, its last at its end)."""
        if self.cu_seqlens is None:
            return None
        inner = [c - self.start for c in self.cu_seqlens if self.start < c < self.end]
        return [0, *inner, self.end - self.start]

    @property
    def last_segment_start(self) -> int:
        """Local offset of the slice's last sequence: the part whose state a later slice may continue."""
        return 0 if self.cu_seqlens is None else self.local_offsets[-2]

    @property
    def carried_from(self) -> int | None:
        """The rank whose slice holds the start of this slice's first sequence, None where it starts here."""
        begins = self.first_sequence_start
        return None if begins == self.start else bisect.bisect_right(self.bounds, begins) - 1
