"""Expert parallelism, in one room: which routed experts a rank holds (`placement`), the expert-parallel module that
replaces a family's experts (`module`: its grouped compute, `compute`, and its token all-to-all, `alltoall` over
`comm`'s checked collectives), expert LoRA in PEFT's adapter layout with the one LoRA scaling rule (`lora_layout`),
its per-rank shards in checkpoints and its slab-wise export (`shards`), and its per-row adapter slots when serving
(`serving_slots`). What DeepSpeed must know of it is said in workers.engine.experts; ZeRO handles everything else.

`placement.job_placement` says which experts this rank holds; `module.parallelize` puts that share of every MoE
block's routed experts into the expert-parallel module."""
