"""LoRA on a built model: PEFT on the linears, PEFT's layout of expert LoRA for export, and coverage (which layer types
a target list adapts, the presets, the table the driver reports)."""
