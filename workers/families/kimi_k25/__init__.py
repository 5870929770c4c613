"""Kimi K2.5, text path: a DeepSeek-V3 language model (MLA attention, grouped sigmoid router with bias correction,
shared experts, first layers dense) under a vision tower and projector (`Kimi_K25ForConditionalGeneration`, the
text model under `model.language_model`); the vision side stays frozen and without LoRA. Its releases store the
routed experts as compressed-tensors INT4 (moetune.api.quantization)."""
