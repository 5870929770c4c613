"""GLM-5-Next: KDA + DSA sparse MLA, sigmoid router with bias correction, a shared expert, SwiGLU with clamping
(`swiglu_limit`), under a vision tower that takes images (workers.methods.multimodal); the tower stays frozen and
without LoRA unless lora.vision says otherwise.
Its indexed attention runs on kernels/sparse_attention (sparse_attention.py) with a query-chunked indexer
(indexer.py)."""
