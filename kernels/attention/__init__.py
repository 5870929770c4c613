"""Softmax attention shapes the families' own SDPA calls do not cover: `trailing_causal_attention`, queries that are
the last of their keys (a context-parallel rank's slice over its row's gathered keys), causal aligned to the bottom
right without a [queries, keys] mask on any device."""
