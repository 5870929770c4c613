"""The plan itself: quantized weights at the bytes kernels.quant stores; the seed-scale model (2.78T parameters)
planned in seconds within 2 GiB; the layout search, the tuner's start and `activation_checkpointing: "auto"`."""

import json
import subprocess
import sys

import pytest
import torch

from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import RunConfig, resolve_run_config
from moetune.api.models.method import Method
from moetune.api.plans import Plan, parse_cluster
from moetune.api.quantization import quantization_of
from moetune.kernels.loss.dispatch import logits_chunk_rows
from moetune.kernels.quant import quantize_fp8_block, quantize_int4, quantize_mxfp4
from moetune.workers.families import REGISTRY
from moetune.workers.planner import plan
from moetune.workers.planner.memory import breakdown, total
from moetune.workers.planner.model import ROUTING_SKEW, model_facts
from moetune.workers.planner.weights import quantized_bytes
from tests.support.layouts import layout
from tests.support import REPO
from bench.support.quantized import FP8_CONFIG, INT4_CONFIG, MXFP4_CONFIG

SEED_JOB = REPO / "examples" / "seed-plan.job.yaml"
H200S = "nodes=8,gpus_per_node=8,gpu_memory=140GiB,nic=400Gbps"


@pytest.mark.parametrize("qc, quantize", [
    ({**FP8_CONFIG, "weight_block_size": [128, 128]}, lambda w: quantize_fp8_block(w, (128, 128))),
    (INT4_CONFIG, lambda w: quantize_int4(w, 32)),
    (MXFP4_CONFIG, quantize_mxfp4),
])
def test_quantized_bytes_are_what_kernels_quant_stores(qc, quantize):
    q = quantization_of({"quantization_config": qc})
    for out, inp in ((256, 512), (320, 192)):
        assert quantized_bytes(q, out, inp) == quantize(torch.randn(out, inp)).nbytes


def test_quantized_experts_are_planned_at_their_stored_size():
    """An INT4 checkpoint of deepseek_v3: the routed experts at INT4, everything its `ignore` names dense."""
    config = {**REGISTRY["deepseek_v3"].tiny_config().to_dict(), "quantization_config": INT4_CONFIG}
    spec = resolve_run_config(JobCreate(model="file:///unused", training_file="file:///unused"), 0)
    dense = model_facts({k: v for k, v in config.items() if k != "quantization_config"}, spec)
    facts = model_facts(config, spec)
    expert_bytes = {t.name: t.nbytes for t in facts.tensors if t.expert}
    assert {t.label for t in facts.tensors if t.expert and not t.name.endswith("_bias")} == {"int4-pack-quantized"}
    assert {t.label for t in facts.tensors if not t.expert} == {"bfloat16", "float32"}
    assert sum(expert_bytes.values()) < sum(t.nbytes for t in dense.tensors if t.expert) / 3


def _as_printed(plan: dict) -> list[str]:
    """What `moetune plan` prints for `plan` on a 120-column terminal, without trailing spaces."""
    import io

    from rich.console import Console

    from moetune.service.cli.plan_view import print_plan

    console = Console(width=120, file=io.StringIO(), record=True)
    print_plan(console, plan)
    return [line.rstrip() for line in console.export_text().splitlines()]


def _readme_seed_plan() -> list[str]:
    """The docs' seed plan example: the code block after the line naming examples/seed-plan.job.yaml."""
    readme = (REPO / "docs" / "parallelism.md").read_text()
    block = readme[readme.index("(`examples/seed-plan.job.yaml`"):].split("```\n", 2)[1]
    return [line.rstrip() for line in block.splitlines()]


def test_the_seed_model_is_planned_in_seconds_within_2_gib():
    code = ("import json, sys, time, yaml; from moetune.api.models.job_create import JobCreate; "
            "from moetune.workers.reporting.system import peak_rss_bytes; "
            "from moetune.api.plans import parse_cluster; from moetune.workers.planner import plan; "
            "from moetune.api.models.run_config import resolve_run_config; "
            f"spec = JobCreate.model_validate(yaml.safe_load(open({str(SEED_JOB)!r}))); "
            f"config = json.load(open({str(REPO / 'examples' / 'seed-model.config.json')!r})); t = time.time(); "
            f"p = plan(config, resolve_run_config(spec, 0), parse_cluster({H200S!r}), "
            "spec.training.activation_checkpointing == 'auto'); "
            "print(json.dumps({'seconds': time.time() - t, 'rss': peak_rss_bytes(), "
            "'plan': p.model_dump(mode='json')}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rss"] < 2 * 2**30 and result["seconds"] < 60
    p = Plan.model_validate(result["plan"])  # the wire form the CLI and the console read
    assert p.model.parameters == 2_783_166_526_912 and p.model.lora_parameters == 31_590_400
    assert not p.submitted.fits  # EP=1: every rank would hold all 5.5 TB of experts
    fit, ep = p.recommended, p.recommended.parallelism.expert_parallel_size
    assert fit.fits and ep > 1 and 896 % ep == 0
    assert fit.tuner_start_micro_batch >= 1 and p.load.seconds > 0
    assert _as_printed(p) == _readme_seed_plan(), (
        "docs/parallelism.md's seed plan is not what the planner gives now: replace its block with the output of "
        "`COLUMNS=120 moetune plan examples/seed-plan.job.yaml --cluster " + H200S + "`")


def _tiny_request(**training) -> JobCreate:
    return JobCreate(model="file:///unused", training_file="file:///unused",
                     training={"global_batch_size": 16, "micro_batch_size": "auto", "seq_len": 4096, **training},
                     parallelism={"num_workers": 4, "gpus_per_worker": 1})


def _tiny_job(**training) -> RunConfig:
    return resolve_run_config(_tiny_request(**training), 0)


def _cluster(gpu_memory_bytes: float):
    return parse_cluster(f"nodes=1,gpus_per_node=4,gpu_memory={gpu_memory_bytes:.0f}B")


def _checkpointing(config: dict, request: JobCreate, gpu_memory_bytes: float) -> bool:
    """What submission resolves the request's `activation_checkpointing` to with the plan on 4 GPUs of that
    memory (api.models.run_config.resolve_run_config)."""
    choose = request.training.activation_checkpointing == "auto"
    planned = plan(config, resolve_run_config(request, 0), _cluster(gpu_memory_bytes), choose)
    return resolve_run_config(request, 0, planned).training.activation_checkpointing


def test_layout_search_takes_the_smallest_fitting_layout_and_the_tuner_start():
    config = REGISTRY["kimi_linear"].tiny_config().to_dict()
    facts = model_facts(config, _tiny_job())
    one = total(breakdown(facts, layout(4, 1, 1, False, 1)))
    four = total(breakdown(facts, layout(4, 1, 1, False, 4)))
    # room for two sequences without recomputation, not for four: the tuner starts at 2 of the 4 per rank
    memory = (one + (four - one) / 2) / 0.9
    p = plan(config, _tiny_job(), _cluster(memory), True, facts)
    assert p.submitted.fits and p.recommended.parallelism.expert_parallel_size == 1
    assert p.recommended.parallelism.zero_stage == 1 and p.recommended.tuner_start_micro_batch == 2
    tight = plan(config, _tiny_job(), _cluster(one * 0.98 / 0.9), True, facts)
    assert tight.recommended.activation_checkpointing is True


def test_an_expert_parallel_rank_is_planned_for_its_busiest_share_of_the_routed_tokens():
    """With EP > 1 a rank's experts receive ROUTING_SKEW times an even share of the routed token copies at their
    busiest: in the experts' saved bytes of every MoE layer and in the all-to-all's receive buffer. At EP=1 a rank
    holds every expert: all copies, no skew."""
    facts = model_facts(REGISTRY["kimi_linear"].tiny_config().to_dict(), _tiny_job())
    even = facts.seq_len * facts.top_k
    assert (facts.routed_slots(1), facts.routed_slots(2)) == (even, ROUTING_SKEW * even)
    saved = facts.expert_saved[True]
    assert saved.per_slot > 0
    unrouted = sum(facts.activations().layers)
    assert sum(facts.layer_bytes(2)) - unrouted == pytest.approx(
        len(facts.moe_layers) * saved.of(facts.num_experts // 2, ROUTING_SKEW * even))
    assert facts.all_to_all_bytes(2) == pytest.approx((1 + ROUTING_SKEW) * even * facts.expert_width
                                                      * facts.compute_bytes)
    assert facts.all_to_all_bytes(1) == 0


def test_the_loss_chunk_is_the_logits_the_loss_holds_at_once():
    """A plan counts the loss's transient logits (kernels.loss.dispatch.logits_chunk_rows): on GPU workers Liger's
    chunk over the micro-batch's tokens in bf16; DPO's loss runs per sequence, so one sequence's chunk; the CPU
    path's fp32 chunk for CPU workers."""
    config = REGISTRY["kimi_linear"].tiny_config().to_dict()
    vocab, hidden, seq = config["vocab_size"], config["hidden_size"], 4096
    sft = model_facts(config, _tiny_job())
    assert breakdown(sft, layout(4, 1, 1, False, 2))["loss_chunk"] == \
        logits_chunk_rows(2 * seq, vocab, hidden, on_cuda=True) * vocab * 2
    dpo = model_facts(config, _tiny_job().model_copy(update={"method": Method(type="dpo")}))
    assert breakdown(dpo, layout(4, 1, 1, False, 1, sequences=2))["loss_chunk"] == \
        logits_chunk_rows(seq, vocab, hidden, on_cuda=True) * vocab * 2
    on_cpu = model_facts(config, _tiny_job(), torch.float32, "cpu")
    assert breakdown(on_cpu, layout(4, 1, 1, False, 2))["loss_chunk"] == \
        logits_chunk_rows(2 * seq, vocab, hidden, on_cuda=False) * vocab * 4


def test_a_dpo_pair_is_planned_as_its_two_sequences():
    """DPO runs a pair's chosen and rejected answers in one micro-batch: a pair costs two sequences' activations and
    logits, so where the tuner starts SFT at 2 examples it starts DPO at 1 pair, and "auto" checkpointing sees it."""
    config = REGISTRY["kimi_linear"].tiny_config().to_dict()
    facts = model_facts(config, _tiny_job())
    assert breakdown(facts, layout(4, 1, 1, False, 1, sequences=2)) == breakdown(facts, layout(4, 1, 1, False, 2))
    one = total(breakdown(facts, layout(4, 1, 1, False, 1)))
    four = total(breakdown(facts, layout(4, 1, 1, False, 4)))
    cluster = _cluster((one + (four - one) / 2) / 0.9)
    dpo = _tiny_job().model_copy(update={"method": Method(type="dpo")})
    per_sequence = model_facts(config, dpo).activation_bytes(1, False)  # measured on a pair, per sequence
    assert per_sequence == pytest.approx(facts.activation_bytes(1, False), rel=0.05)
    assert plan(config, _tiny_job(), cluster, True, facts).recommended.tuner_start_micro_batch == 2
    assert plan(config, dpo, cluster, True, facts).recommended.tuner_start_micro_batch == 1
    two = total(breakdown(facts, layout(4, 1, 1, False, 2)))
    assert not _checkpointing(config, _tiny_request(micro_batch_size=1), two / 0.9 * 1.01)
    assert _checkpointing(config, _tiny_request(micro_batch_size=1).model_copy(update={"method": Method(type="dpo")}),
                          one / 0.9 * 1.01)


def test_auto_checkpointing_is_needed_only_when_the_job_does_not_fit_without():
    config = REGISTRY["kimi_linear"].tiny_config().to_dict()
    request = _tiny_request(micro_batch_size=4)
    without = total(breakdown(model_facts(config, resolve_run_config(request, 0)), layout(4, 1, 2, False, 4)))
    assert not _checkpointing(config, request, without / 0.9 * 1.01)
    assert _checkpointing(config, request, without / 0.9 * 0.99)
    assert _checkpointing(config, _tiny_request(micro_batch_size=4, activation_checkpointing=True), 1e12)


def _k3_request(**training) -> JobCreate:
    return JobCreate(model="file:///unused", training_file="file:///unused",
                     training={"global_batch_size": 16, "micro_batch_size": 1, "seq_len": 4096,
                               "activation_checkpointing": True, **training},
                     parallelism={"num_workers": 4, "gpus_per_worker": 1})


def _smallest(facts, world: int, context: int) -> float:
    """The fewest bytes any layout of `world` GPUs at that CP size holds (EP and ZeRO stage as the plan tries)."""
    return min(total(breakdown(facts, layout(world, ep, zero, True, 1, context=context)))
               for ep in (1, 2, 4) for zero in (1, 2, 3))


def test_context_parallelism_is_chosen_only_where_nothing_fits_without():
    """Kimi K3 has a context-parallel path: where no layout of the job's 4 GPUs holds a whole 4K sequence, the plan
    splits it (CP=2 before 4) and says the fewest GPUs with CP. Kimi-Linear and GLM-5-Next (DSA) have one too: a
    rank of two saves about half of a whole row's activations; Qwen3-Next (Gated DeltaNet), which has none, is never
    split."""
    config = REGISTRY["kimi_k3"].tiny_config().to_dict()
    job = resolve_run_config(_k3_request(), 0)
    facts = model_facts(config, job)
    assert facts.context_sizes == (1, 2, 4)  # slices of at least 1,024 tokens
    whole, halves = _smallest(facts, 4, 1), _smallest(facts, 4, 2)  # DeepSpeed's buckets dominate both
    assert halves < whole
    p = plan(config, job, _cluster(halves / 0.9 * 1.001), False, facts)
    assert not p.submitted.fits and p.recommended.fits
    assert p.recommended.parallelism.context_parallel_size == 2
    assert p.fewest_gpus.parallelism.context_parallel_size > 1
    assert plan(config, job, _cluster(whole / 0.9 * 1.001), False, facts).recommended.parallelism \
        .context_parallel_size == 1
    for name in ("kimi_linear", "glm5_next"):
        other = model_facts(REGISTRY[name].tiny_config().to_dict(), job)
        assert other.context_sizes == (1, 2, 4)
        assert sum(other.activations(2).layers) < 0.6 * sum(other.activations(1).layers)
    gated_delta = REGISTRY["qwen3_next"].tiny_config().to_dict()
    assert model_facts(gated_delta, job).context_sizes == (1,)
    dpo = job.model_copy(update={"method": Method(type="dpo")})  # CP runs supervised jobs only
    assert model_facts(config, dpo).context_sizes == (1,)


def test_a_context_parallel_rank_s_bytes_past_the_measured_slices_are_its_measured_bytes():
    """Beyond 4K-token slices a CP rank's bytes are fitted through three shorter slices (the measure's cost grows
    with the slice): the fit gives what a forward of the longer slice saves, layer by layer."""
    from moetune.workers.planner.activations import _measure

    config = REGISTRY["kimi_k3"].tiny_config().to_dict()
    facts = model_facts(config, resolve_run_config(_k3_request(seq_len=16384), 0))
    model, method, _, device_type = facts.measure.args
    fitted, measured = facts.activations(2), _measure(model, method, 8192, 2, device_type)
    assert fitted.layers == pytest.approx(measured.layers, rel=0.01)
    assert fitted.loss == pytest.approx(measured.loss, rel=0.01)
    assert fitted.layers != pytest.approx(facts.activations(4).layers, rel=0.1)
