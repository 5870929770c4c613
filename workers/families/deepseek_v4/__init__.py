"""DeepSeek-V4: every layer a MoE layer under manifold-constrained hyper-connections (the residual is `hc_mult`
streams mixed in and out of each block), shared-KV attention with sinks over a sliding window plus compressed
entries (CSA: compressed and indexer-selected, HCA: heavily compressed), and a grouped low-rank output projection.
Its first layers route by a frozen token-id -> expert table (hash MoE), the rest by a bias-corrected top-k; both
routers run unchanged under expert parallelism, as do the compressors and hyper-connections (transformers' code).
The routed experts clamp gate and up at `swiglu_limit` (`experts.limit`)."""
