"""Kimi K3 (moetune's own model definition) against NeMo Automodel 0.7.0's reference, on tiny checkpoints the
reference writes in the release's naming: bf16, and with the routed experts in compressed-tensors'
mxfp4-pack-quantized per expert. moetune's model comes from its streaming loader; both models run in fp32 for the
comparison (the reference in a child process). The same child run decodes greedily for the serving engine's test
and, on a third checkpoint with a tiny MoonViT3d tower and patchmergerv2 projector, computes image features and the
logits of a batch with images."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from moetune.api.families import check_model_spec
from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.api.models.lora import LoraSpec
from moetune.api.models.training import TrainingSpec
from moetune.api.plans import ClusterSpec
from moetune.workers.evaluation.alignment import check_alignment
from moetune.workers.families import apply_kernel_swaps
from moetune.workers.families.kimi_k3.processor import KimiK3ImageProcessor
from moetune.workers.families.kimi_k3.tiny import TINY_TEXT, TINY_VISION, TINY_VISION_CONFIG, tiny_config
from moetune.workers.model import trainable_model
from moetune.workers.experts.placement import placement_at
from moetune.workers.planner.plan import plan
from moetune.workers.weights.loader import stream_model
from moetune.workers.weights.push import inspect
from bench.support.kimi_k3_reference import LORA_TARGETS, run_reference

# the engine test's prompts (different lengths: rows join left-padded) and expert LoRA (rank 4, alpha 8)
PROMPTS = ([7, 99, 180, 23, 250, 61, 5, 140, 33], [44, 201, 9, 130])
NEW_TOKENS, EXPERT_RANK = 8, 4
MOE_LAYERS = range(TINY_TEXT["first_k_dense_replace"], TINY_TEXT["num_hidden_layers"])
# the vision checkpoint's image token, and its images: two pictures through the tiny processor (100x70: a 6x8 grid,
# so the 8x8 position table is resized; 30x20: 2x4) and a two-frame clip of 2x2 patches (time embedding, pooling)
PLACEHOLDER = TINY_TEXT["vocab_size"] - 1
PICTURES, CLIP_GRID = ((100, 70), (30, 20)), (2, 2, 2)


def _expert_lora() -> dict[str, dict[str, torch.Tensor]]:
    """experts module path -> moetune's fused-expert LoRA factors (lora_gate_up_a [E, r, latent], ...)."""
    g = torch.Generator().manual_seed(3)
    e, latent, inner = TINY_TEXT["num_experts"], TINY_TEXT["routed_expert_hidden_size"], \
        TINY_TEXT["moe_intermediate_size"]
    shapes = {"lora_gate_up_a": (e, EXPERT_RANK, latent), "lora_gate_up_b": (e, 2 * inner, EXPERT_RANK),
              "lora_down_a": (e, EXPERT_RANK, inner), "lora_down_b": (e, latent, EXPERT_RANK)}
    return {f"language_model.model.layers.{i}.block_sparse_moe.experts":
            {name: torch.randn(shape, generator=g) * 0.3 for name, shape in shapes.items()} for i in MOE_LAYERS}


def _released_expert_deltas(lora: dict, scaling: float) -> dict[str, torch.Tensor]:
    """The expert LoRA as merged deltas of the release's per-expert w1 / w3 / w2 (gate_up_proj rows: w1, then w3)."""
    deltas = {}
    for path, f in lora.items():
        gate_up = scaling * f["lora_gate_up_b"] @ f["lora_gate_up_a"]
        down = scaling * f["lora_down_b"] @ f["lora_down_a"]
        for e in range(gate_up.shape[0]):
            w1, w3 = gate_up[e].chunk(2)
            deltas.update({f"{path}.{e}.w1.weight": w1, f"{path}.{e}.w3.weight": w3, f"{path}.{e}.w2.weight": down[e]})
    return deltas


def _vision_inputs() -> dict:
    """The images as moetune's processor gives them (plus the clip's random patches); "input_ids": one row with
    the three images between text, one placeholder each (as the reference takes it); "expanded_ids": that row with
    each placeholder repeated once per image token (as moetune's data path writes them) and a text-only row."""
    from PIL import Image

    g = torch.Generator().manual_seed(4)
    processor = TINY_VISION.image_processor(TINY_VISION_CONFIG)
    pictures = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
                for w, h in PICTURES]
    processed = processor(images=pictures, return_tensors="pt")
    clip = torch.randn(int(torch.tensor(CLIP_GRID).prod()), 3, 14, 14, generator=g)
    grid = torch.cat((processed["image_grid_thw"], torch.tensor([CLIP_GRID])))
    tokens = (grid[:, 1] * grid[:, 2] // 4).tolist()
    text = torch.randint(3, PLACEHOLDER, (3, 4), generator=g).tolist()
    row = text[0] + [PLACEHOLDER] + text[1] + [PLACEHOLDER, PLACEHOLDER] + text[2]
    expanded = [token for t in row for token in ([t] if t != PLACEHOLDER else [t] * tokens.pop(0))]
    other = torch.randint(3, PLACEHOLDER, (len(expanded),), generator=g).tolist()
    return {"pixel_values": torch.cat((processed["pixel_values"], clip)), "grid_thws": grid,
            "input_ids": torch.tensor([row]), "expanded_ids": torch.tensor([expanded, other])}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("kimi-k3-reference"))
    ids = torch.randint(3, TINY_TEXT["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    torch.save(_released_expert_deltas(_expert_lora(), 8 / EXPERT_RANK), os.path.join(workdir, "expert_deltas.pt"))
    torch.save(_vision_inputs(), os.path.join(workdir, "vision_inputs.pt"))
    request = {"seed": 0, "input_ids": ids.tolist(), "lora_targets": LORA_TARGETS, "text_config": TINY_TEXT,
               "decode": {"prompts": [list(p) for p in PROMPTS], "new_tokens": NEW_TOKENS,
                          "expert_deltas": "expert_deltas.pt"},
               "vision": {"vision_config": TINY_VISION_CONFIG, "placeholder_token_id": PLACEHOLDER}}
    return workdir, ids, run_reference(workdir, request)


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _stream(folder: str, base_weights: str = "dequantized"):
    return stream_model(f"file://{folder}", torch.device("cpu"), torch.float32, cache_dir="",
                        base_weights=base_weights)


def test_layer_kinds_from_the_released_one_indexed_lists():
    text = tiny_config().text_config
    assert text.layer_types == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    assert text.num_experts_per_tok == 2 and text.n_routed_experts == 8  # moetune's generic names
    released = type(text)()
    assert (released.layer_types.count("linear_attention"), released.layer_types.count("full_attention")) == (69, 24)


def test_a_variant_the_release_does_not_use_is_refused():
    from huggingface_hub.errors import StrictDataclassClassValidationError

    with pytest.raises(StrictDataclassClassValidationError, match="mla_use_nope"):
        tiny_config(mla_use_nope=False)


def test_checkpoint_is_in_the_released_naming(reference):
    workdir, _, _ = reference
    bf16, packed = _tensors(f"{workdir}/bf16"), _tensors(f"{workdir}/mxfp4")
    layer = "language_model.model.layers"
    assert f"{layer}.1.block_sparse_moe.experts.7.w2.weight" in bf16
    assert bf16[f"{layer}.0.self_attn.A_log"].shape == (128,)  # 4 heads, padded as released
    assert bf16[f"{layer}.0.self_attn.q_conv1d.weight"].shape == (64, 1, 4)
    assert {f"{layer}.3.block_sparse_moe.experts.0.w1.weight_packed", f"{layer}.3.block_sparse_moe.experts.0.w1."
            "weight_scale"} <= set(packed)
    assert packed[f"{layer}.3.block_sparse_moe.experts.0.w1.weight_packed"].dtype == torch.uint8
    assert "vision_tower" not in json.dumps(sorted(bf16))  # the text reference's (the tower's is in vision/)


def test_loaded_state_dict_is_the_checkpoint(reference):
    """Every released tensor lands in moetune's model under its own name; the per-expert w1/w3/w2 become the fused
    experts (w1 rows, then w3 rows)."""
    workdir, _, _ = reference
    released = _tensors(f"{workdir}/bf16")
    ours = _stream(f"{workdir}/bf16").model.state_dict()
    experts = "language_model.model.layers.2.block_sparse_moe.experts"
    fused = torch.stack([torch.cat((released[f"{experts}.{e}.w1.weight"], released[f"{experts}.{e}.w3.weight"]))
                         for e in range(8)])
    assert torch.equal(ours[f"{experts}.gate_up_proj"], fused.float())
    assert torch.equal(ours[f"{experts}.down_proj"],
                       torch.stack([released[f"{experts}.{e}.w2.weight"] for e in range(8)]).float())
    plain = {k: v for k, v in released.items() if ".experts." not in k}
    assert set(plain) == {k for k in ours if ".experts." not in k}
    assert all(torch.equal(ours[k], v.float()) for k, v in plain.items())


def _with_reference_lora(model, weights: dict[str, torch.Tensor]):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    params = {n.removeprefix("base_model.model."): p for n, p in peft.named_parameters() if "lora_" in n}
    assert set(params) == set(weights)  # same LoRA modules under the same (released) names
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    return peft, params


@pytest.mark.parametrize("kernels", [False, True], ids=["stock", "swapped"])
@pytest.mark.parametrize("checkpoint", ["bf16", "mxfp4"])
def test_logits_loss_and_lora_gradients_equal_the_reference(reference, checkpoint, kernels):
    """The MXFP4 checkpoint dequantized at load (the kept-quantized base is the next test's)."""
    workdir, ids, results = reference
    expected = results[checkpoint]
    model = _stream(f"{workdir}/{checkpoint}").model
    if kernels:  # KDA on kernels.kda, packed-sequence MLA
        assert apply_kernel_swaps(model) == {"apply_kda_kernels": 2, "apply_segment_attention": 2}
    model, lora = _with_reference_lora(model, expected["lora_weights"])
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits, expected["logits"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.loss, expected["loss"], rtol=1e-5, atol=1e-5)
    for name, grad in expected["lora_grads"].items():
        assert grad.abs().max() > 0, name  # every compared gradient carries signal
        torch.testing.assert_close(lora[name].grad, grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_mxfp4_experts_stay_packed_and_train_as_the_dequantized_base(reference):
    """Streamed kept quantized, the routed experts are held as MXFP4 in the fused experts' layout (per-expert packed
    rows merged, w1 then w3), a quarter of their bf16 bytes plus the scales; a LoRA job's model (expert LoRA
    included) gives the logits and gradients of the same checkpoint dequantized at load."""
    workdir, ids, _ = reference
    kept = _stream(f"{workdir}/mxfp4", "quantized")
    experts = kept.model.language_model.model.layers[2].block_sparse_moe.experts
    assert {k: tuple(v.shape) for k, v in experts.named_buffers()} == {
        "gate_up_proj_q_blocks": (8, 64, 1, 16), "gate_up_proj_q_scales": (8, 64, 1),
        "down_proj_q_blocks": (8, 32, 1, 16), "down_proj_q_scales": (8, 32, 1)}
    bf16_bytes = 3 * 8 * (64 * 32 + 32 * 32) * 2  # 3 MoE layers of 8 experts
    assert kept.quantized_bytes == bf16_bytes * (1 / 4 + 1 / 64)
    lora = LoraSpec(rank=4, alpha=8, dropout=0.0, train_experts=True)
    runs = []
    for streamed in (kept, _stream(f"{workdir}/mxfp4")):
        apply_kernel_swaps(streamed.model)
        torch.manual_seed(1)
        placement = placement_at(streamed.model.config.to_dict(), 1, 0)
        model = trainable_model(streamed.model, lora, TrainingSpec(), placement)
        with torch.no_grad():  # LoRA B != 0, so that the experts' LoRA A gets gradients too
            for name, p in model.named_parameters():
                if "lora_" in name and ("lora_B" in name or "_b" in name.rsplit(".", 1)[-1]):
                    p.normal_(0, 0.1)
        if streamed is kept:  # the job-start alignment check, on K3's swapped operators over the packed experts
            rows = check_alignment(model, lambda: model(input_ids=ids, labels=ids).loss, torch.float32)
            assert [(r["op"], r["ok"]) for r in rows] == [("kda", True), ("experts", True), ("first loss", True)]
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        runs.append((out.logits, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (logits, grads), (dense_logits, dense_grads) = runs
    torch.testing.assert_close(logits, dense_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == dense_grads.keys() and any(".experts.lora_" in n for n in grads)
    for name, grad in dense_grads.items():
        assert grad is not None and grad.abs().max() > 0, name
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_released_checkpoint_is_accepted_and_inspected(reference):
    workdir, _, _ = reference
    with open(f"{workdir}/mxfp4/config.json") as f:
        config = json.load(f)
    spec = JobCreate(model="file:///unused", training_file="file:///unused.jsonl",
                     lora={"target_modules": ["q_proj", "g_proj", "kv_b_proj", "routed_expert_down_proj"]},
                     parallelism={"expert_parallel_size": 2, "num_workers": 2})
    check_model_spec(config, spec.lora, spec.parallelism)
    summary = inspect(f"file://{workdir}/mxfp4", ep=2)
    assert (summary["model_type"], summary["quantization"]) == ("kimi_k3", "mxfp4-pack-quantized")
    assert (summary["moe_layers"], summary["experts_per_layer"]) == (3, 8)
    assert summary["expert_parameters"] == 3 * 8 * (64 * 32 + 32 * 32)


@pytest.mark.parametrize("ep", [1, 2])
def test_the_planner_counts_the_packed_experts_the_loader_keeps(reference, ep):
    workdir, _, _ = reference
    with open(f"{workdir}/mxfp4/config.json") as f:
        config = json.load(f)
    spec = JobCreate(model="file:///unused", training_file="file:///unused.jsonl", lora={"rank": 4},
                     training={"seq_len": 64, "global_batch_size": 2, "micro_batch_size": 1},
                     parallelism={"expert_parallel_size": ep, "num_workers": 2})
    frozen = plan(config, resolve_run_config(spec, 0), ClusterSpec(nodes=1, gpus_per_node=2,
                                                                   gpu_memory="80GB")).submitted.bytes
    kept = _stream(f"{workdir}/mxfp4", "quantized").quantized_bytes
    assert frozen["frozen_weights"]["mxfp4-pack-quantized"] == kept / ep


def _write_adapter(folder: str, linear_lora: dict[str, torch.Tensor]) -> str:
    """A PEFT adapter in moetune's export layout: the reference's linear LoRA (released names) and `_expert_lora`
    as target_parameters on the fused experts."""
    from safetensors.torch import save_file

    from moetune.workers.experts.lora_layout import peft_expert_state, target_parameters

    tensors = {f"base_model.model.{name.replace('.default.', '.')}": t for name, t in linear_lora.items()}
    for path, factors in _expert_lora().items():
        tensors.update(peft_expert_state(f"base_model.model.{path}", factors))
    os.makedirs(folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": EXPERT_RANK, "lora_alpha": 8, "target_modules": LORA_TARGETS,
                   "target_parameters": target_parameters()}, f)
    return folder


def test_engine_greedy_decode_equals_the_reference(reference, tmp_path):
    """The serving engine on the MXFP4 checkpoint (experts kept packed), base and adapter (linear + expert LoRA)
    rows in one batch: rows prefilled alone, joining a running batch left-padded (KDA conv + recurrent states, MLA
    latent KV), leaving at different lengths; every answer is the reference's greedy decode token for token."""
    from moetune.workers.generate import Engine, GenerationRequest, SamplingParams
    from moetune.workers.tiny import write_tiny_tokenizer

    workdir, _, results = reference
    checkpoint = str(tmp_path / "served")
    shutil.copytree(f"{workdir}/mxfp4", checkpoint)
    write_tiny_tokenizer(checkpoint)
    adapter = _write_adapter(str(tmp_path / "adapter"), results["mxfp4"]["lora_weights"])
    runs = [(PROMPTS[0], adapter, NEW_TOKENS), (PROMPTS[1], None, NEW_TOKENS), (PROMPTS[1], adapter, 5),
            (PROMPTS[0], None, 6)]

    async def answers(engine):
        async def one(prompt, uri, n):
            request = GenerationRequest(list(prompt), uri, SamplingParams(n, temperature=0.0))
            return [e.token_id async for e in engine.stream(request) if e.token_id is not None]
        first = asyncio.create_task(one(*runs[0]))
        while not engine.batch.steps and not first.done():  # the others join a batch that is already decoding
            await asyncio.sleep(0.01)
        return [await first, *await asyncio.gather(*(one(*r) for r in runs[1:]))]

    engine = Engine.from_uri(checkpoint, max_batch=4)
    try:
        got = asyncio.run(answers(engine))
        stop_ids, peak = engine.base.stop_ids, engine.stats()["peak_batch"]
    finally:
        engine.close()
    decoded = results["decode"]

    def expected(prompt, uri, n):
        tokens = decoded["adapter" if uri else "base"][PROMPTS.index(prompt)][:n]
        return next((tokens[:i] for i, t in enumerate(tokens) if t in stop_ids), tokens)

    assert got == [expected(*r) for r in runs]
    assert peak >= 3 and all(got) and decoded["base"] != decoded["adapter"]  # batched, and the adapter matters


def test_vision_checkpoint_loads_whole_and_sees_images_as_the_reference(reference):
    """The reference's multimodal checkpoint (vision_tower., mm_projector. as released) loads with no tensor unread;
    each image's projected features, its token count and the logits of the row holding the images equal the
    reference's (fp32); in the same batch, a text-only row's logits are those of the row alone."""
    workdir, _, results = reference
    expected = results["vision"]
    streamed = _stream(f"{workdir}/vision")
    assert streamed.plan.unexpected == []
    released, ours = _tensors(f"{workdir}/vision"), streamed.model.state_dict()
    vision = {k: v for k, v in released.items() if k.startswith(("vision_tower.", "mm_projector."))}
    assert len(vision) == 12 and all(torch.equal(ours[k], v.float()) for k, v in vision.items())
    model, inputs = streamed.model.eval(), torch.load(f"{workdir}/vision_inputs.pt")
    with torch.no_grad():
        features = model.get_image_features(inputs["pixel_values"], inputs["grid_thws"])
        torch.testing.assert_close(features, expected["features"], rtol=1e-5, atol=1e-5)
        tokens = (inputs["grid_thws"][:, 1] * inputs["grid_thws"][:, 2] // 4).tolist()
        assert tokens == expected["tokens_per_image"] == [12, 2, 1]
        ids = inputs["expanded_ids"]
        logits = model(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["grid_thws"]).logits
        torch.testing.assert_close(logits[:1], expected["logits"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[1:], model(input_ids=ids[1:]).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="15 image placeholder tokens in input_ids, but the images give 14"):
        model(input_ids=ids[:1], pixel_values=inputs["pixel_values"][:-8], image_grid_thw=inputs["grid_thws"][:2])


def _k25_resize_rule():
    """transformers' Kimi K2.5 resize rule (`navit_resize`): its module imports torchvision, which this
    environment lacks, so the function alone is compiled from the module's source."""
    import ast
    import math

    import transformers

    path = os.path.join(os.path.dirname(transformers.__file__), "models", "kimi_k25", "image_processing_kimi_k25.py")
    tree = ast.parse(open(path).read())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    scope = {"math": math}
    exec(compile(ast.Module([function], type_ignores=[]), path, "exec"), scope)
    return scope["navit_resize"]


def test_image_token_counts_follow_the_released_processor_rule():
    """Released sizes (512 patches a side, 16384 patches): for every image size the grid moetune's processor gives
    (and the driver's row-length check counts) is K2.5's rule's, so an image makes as many tokens; an image that
    is processed has that grid and 3x14x14 patches normalised to [-1, 1] (zero padding is -1)."""
    from PIL import Image

    navit_resize = _k25_resize_rule()
    processor = KimiK3ImageProcessor()
    for height, width in [(70, 100), (20, 30), (13, 13), (1000, 3000), (5000, 200), (7200, 9600), (2000, 2000)]:
        _, (padded_h, padded_w) = navit_resize(height, width, 14, 2, 16384, 512)
        assert processor.get_number_of_image_patches(height, width) == (padded_h // 14) * (padded_w // 14), \
            (height, width)
    out = processor(images=[Image.new("RGB", (3000, 1000), (255, 0, 0))], return_tensors="pt")
    _, (padded_h, padded_w) = navit_resize(1000, 3000, 14, 2, 16384, 512)
    assert out["image_grid_thw"].tolist() == [[1, padded_h // 14, padded_w // 14]]
    assert out["pixel_values"].shape == (padded_h * padded_w // 196, 3, 14, 14)
    assert out["pixel_values"][:, 0].max() == 1 and out["pixel_values"][:, 1].min() == -1


def test_image_rows_train_the_vision_lora(tmp_path):
    """Mixed image and text rows of the tiny K3 (its released checkpoint with the tiny tower, tokenizer with
    <|media_pad|>, processor config) through the job's data path: each image part becomes its run of placeholder
    tokens, the batch carries the pixels, and lora.vision="all" puts LoRA on every linear of the tower and the
    projector, each getting a gradient; "projector" adapts the projector alone."""
    from moetune.workers.families import REGISTRY
    from moetune.workers.tiny import tiny_image_rows, write_tiny_multimodal_checkpoint
    from moetune.workers.methods.sft import token_loss_sum
    from bench.support.image_batches import image_method

    checkpoint = write_tiny_multimodal_checkpoint(str(tmp_path / "vl"), REGISTRY["kimi_k3"].tiny_config)
    method = image_method(checkpoint, 256)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    examples, _ = method.examples(tiny_image_rows(2, seed=3) + [chat])
    batch = method.collate(examples)
    placeholder = method.images.image_token_id
    assert (batch.inputs["input_ids"] == placeholder).sum(-1).tolist()[:2] == \
        (batch.inputs["image_grid_thw"].prod(-1) // 4).tolist() and batch.inputs["input_ids"][2].ne(placeholder).all()
    for vision, adapted in (("all", {"wqkv", "wo", "fc0", "fc1", "0", "2"}), ("projector", {"0", "2"})):
        lora_spec = LoraSpec(rank=4, alpha=8, dropout=0.0, vision=vision)
        torch.manual_seed(2)
        streamed = _stream(checkpoint)
        placement = placement_at(streamed.model.config.to_dict(), 1, 0)
        model = trainable_model(streamed.model, lora_spec, TrainingSpec(), placement)
        with torch.no_grad():  # LoRA B != 0, so that A gets gradients too
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        token_loss_sum(model(**batch.inputs).logits, batch.labels).backward()
        lora = {n: p for n, p in model.named_parameters() if "lora_" in n and ("vision_tower" in n or "mm_proj" in n)}
        assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora} == adapted, vision
        assert all(p.grad is not None and p.grad.abs().max() > 0 for p in lora.values()), vision
