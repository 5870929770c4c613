"""The DeepSpeed ZeRO engine over a built model (the only room that touches DeepSpeed's internals), the learning-rate
schedule, and the prebuilt DeepSpeed C++ op."""
