"""Kimi-Linear (the seed family, the embedded demo's model): KDA + MLA attention, sigmoid router with bias
correction, a shared expert. With its kernel swaps, micro-batches are packed: every layer keeps packed sequences apart
(workers.families.segments)."""
