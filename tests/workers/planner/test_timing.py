"""The planner's step-time estimate (workers.planner.timing) and pipeline stages' memory (workers.planner.memory):
the operations it counts are what transformers' model runs, a collective crosses the link its group needs, a
pipeline's stages together hold the model once, and the plan recommends the fastest layout a job can run."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.api.plans import parse_cluster
from moetune.workers.families import REGISTRY
from moetune.workers.planner import plan
from moetune.workers.planner.memory import breakdown, stage_breakdown, total
from moetune.workers.planner.model import model_facts
from moetune.workers.planner.timing import estimate
from tests.support.layouts import layout

SEQ = 64


def _job(seq_len: int = SEQ, workers: int = 4, method: str = "supervised", **training):
    return resolve_run_config(JobCreate(model="file:///unused", training_file="file:///unused",
                                        training={"seq_len": seq_len, "global_batch_size": 8, **training},
                                        parallelism={"num_workers": workers, "gpus_per_worker": 1},
                                        method={"type": method}), 0)


def test_a_tokens_matmul_operations_are_what_transformers_runs():
    """Qwen3-MoE's forward in transformers (experts looped, eager) counted by torch's FLOP counter: every matmul,
    the router's and the top-k experts' included, is the planner's weights per token (the LoRA's aside)."""
    config = REGISTRY["qwen3_moe"].tiny_config()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    with FlopCounterMode(display=False) as counted, torch.no_grad():
        model(input_ids=torch.randint(0, config.vocab_size, (1, SEQ)))
    facts = model_facts(config.to_dict(), _job(), torch.float32, "cpu")
    lora = facts.lora_dense + facts.lora_experts * facts.top_k / facts.num_experts
    assert 2 * SEQ * (sum(facts.linear_elements(1)) - lora + facts.head_elements) == counted.get_total_flops()


def test_attention_operations_are_each_querys_causal_keys():
    """Softmax attention: q·kᵀ and p·v over each query's keys up to itself; a context-parallel rank's MLA queries
    (the last of two: the row's second half) see every key before them too."""
    config = REGISTRY["qwen3_moe"].tiny_config()
    heads, width = config.num_attention_heads, 2 * config.head_dim
    facts = model_facts(config.to_dict(), _job())
    assert facts.activations(1).attention_flops == (2 * heads * SEQ * (SEQ + 1) / 2 * width,) * 2
    k3 = REGISTRY["kimi_k3"].tiny_config().get_text_config()
    facts = model_facts(REGISTRY["kimi_k3"].tiny_config().to_dict(), _job(custom_kernels=True))
    half = SEQ // 2
    mla_width = 2 * (k3.qk_nope_head_dim + k3.qk_rope_head_dim)  # its values padded to the queries' width
    pairs = half * half + half * (half + 1) / 2
    mla = [i - 1 for i in k3.linear_attn_config["full_attn_layers"]]
    expected = 2 * k3.num_attention_heads * pairs * mla_width
    assert [facts.activations(2).attention_flops[i] for i in mla] == [expected] * 2
    assert facts.activations(2).received > 0  # the gathered latents, counted for the exchange's time


def test_a_collective_crosses_the_link_its_group_needs():
    """Expert parallelism within a node moves its all-to-all over NVLink: a slower network changes nothing; over
    two nodes the all-to-all's time grows as the network slows."""
    facts = model_facts(REGISTRY["qwen3_moe"].tiny_config().to_dict(), _job(workers=8))

    def all_to_all(ep: int, network: str) -> float:
        cluster = parse_cluster(f"nodes=2,gpus_per_node=4,gpu_memory=80,network={network}")
        return estimate(facts, layout(8, ep, 2, False, 1), cluster, 8).seconds["all_to_all"]

    assert all_to_all(4, "400Gbps") == all_to_all(4, "1Gbps") > 0
    assert all_to_all(8, "1Gbps") == pytest.approx(400 * all_to_all(8, "400Gbps"))


def test_pipeline_stages_hold_the_model_once_and_the_first_holds_most_activations():
    """Kimi K3's stages keep its Attention-Residual blocks whole; their frozen tensors are the model's, each on one
    stage; under 1F1B the first stage holds two micro-batches' layer inputs, the last one; the stages' estimated
    operations are the unstaged model's, and the step waits in the bubble."""
    facts = model_facts(REGISTRY["kimi_k3"].tiny_config().to_dict(), _job())
    assert facts.stage_layers(2) == [range(0, 2), range(2, 4)] and facts.most_stages == 2
    held = [facts.stage_tensors(2, stage) for stage in (0, 1)]
    assert sorted(t.name for t in held[0] + held[1]) == sorted(t.name for t in facts.tensors)
    whole = breakdown(facts, layout(4, 1, 1, True, 1))["frozen_weights"]
    staged = [stage_breakdown(facts, layout(4, 1, 1, True, 1, stages=2), s)["frozen_weights"] for s in (0, 1)]
    assert {k: staged[0].get(k, 0) + staged[1].get(k, 0) for k in whole} == pytest.approx(whole)
    first, last = (stage_breakdown(facts, layout(4, 1, 1, True, 1, stages=2), s) for s in (0, 1))
    measured = facts.activations(1)
    assert first["pipeline_buffers"] > 0 and last["logits"] > 0 == first["logits"]
    kept = measured.before_layers + measured.layer_inputs[0] + measured.layer_inputs[1]  # one micro-batch's
    assert first["activations"] == 2 * kept + max(facts.layer_bytes(1)[:2])
    one, two = (estimate(facts, layout(4, 1, 1, True, 1, stages=s), parse_cluster("nodes=1,gpus_per_node=4,"
                                                                                 "gpu_memory=80"), 8)
                for s in (1, 2))
    assert two.flops_per_token == pytest.approx(one.flops_per_token)
    assert two.bubble_fraction == pytest.approx(1 / (two.micro_batches + 1)) and one.bubble_fraction == 0


@pytest.mark.parametrize("method", ["supervised", "dpo"])
def test_the_plan_recommends_the_fastest_layout_a_job_can_run(method):
    """Pipeline stages run supervised jobs, not DPO's."""
    config = REGISTRY["kimi_k3"].tiny_config().to_dict()
    job = _job(method=method)
    p = plan(config, job, parse_cluster("nodes=1,gpus_per_node=4,gpu_memory=80"), False)
    steps = [fit.time.step_seconds for fit in p.tradeoffs]
    assert steps == sorted(steps) and p.recommended == min((f for f in p.tradeoffs if f.available),
                                                           key=lambda f: f.time.step_seconds)
    staged = {f.available for f in p.tradeoffs if f.parallelism.pipeline_parallel_size > 1}
    assert staged == {method == "supervised"}
    assert p.runner_up.time.step_seconds >= p.recommended.time.step_seconds
    assert p.runner_up_slower.split(":")[0].endswith("the step time (estimated)")


@pytest.mark.parametrize("family", sorted(REGISTRY))
def test_every_family_is_planned_with_its_stages_and_step_times(family):
    """Whatever a family names its text model's parts (Nemotron-H's `embeddings`), its tensors find their layers
    and stages, and each fitting layout gets a step time."""
    facts = model_facts(REGISTRY[family].tiny_config().to_dict(), _job())
    assert {t.layer for t in facts.tensors if t.layer is not None} == set(range(facts.num_layers))
    p = plan(REGISTRY[family].tiny_config().to_dict(), _job(), parse_cluster("nodes=1,gpus_per_node=4,gpu_memory=80"),
             False, facts)
    assert p.recommended.time.step_seconds > 0 and p.tradeoffs
