"""DeepSeek-V3: MLA attention, grouped sigmoid router with bias correction, shared experts, first layers dense. With
its kernel swap, micro-batches are packed (attention is its only layer that mixes tokens: workers.families.segments)
and the MLA attention runs at the key width (workers.families.mla)."""
