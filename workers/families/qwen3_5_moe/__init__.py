"""Qwen3.5 MoE, text path: Gated DeltaNet linear attention in 3 of 4 layers, gated full attention, softmax router,
a sigmoid-gated shared expert. The checkpoint is multimodal (`Qwen3_5MoeForConditionalGeneration`, the text model
under `model.language_model`); the vision tower stays frozen and without LoRA unless lora.vision says otherwise.
The DeltaNet core runs on `kernels.kda` (workers.families.kda)."""
