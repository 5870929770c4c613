"""gpt-oss: attention with sinks (alternating sliding-window / full layers), a biased softmax-top-k router and
biased experts stored transposed ([E, in, out]) with gate and up interleaved, under a clamped SwiGLU. Its released
checkpoints keep the experts in MXFP4."""
