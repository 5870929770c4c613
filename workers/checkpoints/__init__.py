"""Resumable checkpoints: DeepSpeed state without frozen weights, each rank's expert and expert-LoRA shards,
the PEFT adapter, and the run state (manifests, attempts, OOM records, retention) that says which checkpoint is complete."""
