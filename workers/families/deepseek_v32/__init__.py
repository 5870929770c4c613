"""DeepSeek-V3.2: DeepSeek-V3 (MLA, grouped sigmoid router, shared experts) with DeepSeek Sparse Attention: a
lightweight indexer picks each query's top-k (2048) keys and MLA attends over those only. Its swap (dsa.py) runs
the selection chunked over queries and the attention on kernels/sparse_attention, without a T×T tensor."""
