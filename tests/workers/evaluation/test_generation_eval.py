"""Generation-based evaluation in process on the tiny kimi_linear (kernels swapped, PEFT LoRA as the job builds
it): the scores equal those of the same rows answered by transformers' own `generate` on the unswapped model with
the same adapter loaded by PEFT; with LoRA untouched (step 0) they equal the base model's."""

from __future__ import annotations

import json

import boto3
import pytest
import torch

from moetune.api import storage
from moetune.api.models import EVAL_METRICS, EvaluationSpec, JobCreate
from moetune.workers.errors import JobError
from moetune.workers.evaluation.generation import evaluate_generation, load_eval_rows, prompt_ids
from moetune.workers.evaluation.metrics import METRICS, chrf, exact_match, rouge_l, token_f1
from moetune.workers.families import apply_kernel_swaps
from moetune.workers.model import trainable_model
from moetune.workers.tiny import tiny_rows, write_tiny_checkpoint

MAX_NEW, ROWS = 4, 4
# every metric but regex, whose references are patterns (test_metrics_follow_their_definitions)
SPEC = EvaluationSpec(file="s3://unused/eval.jsonl", metrics=[m for m in EVAL_METRICS if m != "regex"],
                      max_new_tokens=MAX_NEW)
JOB = JobCreate(model="file:///unused", training_file="file:///unused.jsonl",
                lora={"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("model")))
    return path, AutoTokenizer.from_pretrained(path), lambda: AutoModelForCausalLM.from_pretrained(path).eval()


def _hf_answers(model, tokenizer, prompts: list[list[int]]) -> list[str]:
    """transformers' greedy generate, one prompt at a time (no padding to get wrong)."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            out.append(tokenizer.decode(generated[0, len(ids):], skip_special_tokens=True))
    return out


def _mean_scores(texts: list[str], references: list[str]) -> dict[str, float]:
    return {m: sum(METRICS[m](t, r) for t, r in zip(texts, references)) / len(texts) for m in SPEC.metrics}


@pytest.fixture(scope="module")
def eval_bucket(s3_endpoint):
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="eval-rows")
    return "eval-rows"


@pytest.fixture(scope="module")
def rows_and_base(tiny, eval_bucket):
    """Chat rows, half with the base model's own greedy answer as reference (planted hits), half with another
    row's answer (the first from its final assistant turn, the others from "reference"), and the base model's
    answers to them."""
    _, tokenizer, plain = tiny
    chats = [r["messages"][:-1] for r in tiny_rows(4 * ROWS, seed=4) if "messages" in r][:ROWS]
    base = _hf_answers(plain(), tokenizer, [prompt_ids(tokenizer, m) for m in chats])
    references = [base[i] if i % 2 else base[(i + 1) % ROWS] for i in range(ROWS)]
    lines = [{"messages": chats[0] + [{"role": "assistant", "content": references[0]}]}]
    lines += [{"messages": m, "reference": ref} for m, ref in zip(chats[1:], references[1:])]
    uri = f"s3://{eval_bucket}/rows.jsonl"
    storage.write_bytes(uri, "".join(json.dumps(line) + "\n" for line in lines).encode())
    rows = load_eval_rows(uri, tokenizer, SPEC.metrics)
    assert [r.prompt_ids for r in rows] == [prompt_ids(tokenizer, m) for m in chats]
    return rows, base


def _job_model(tiny, lora_b_seed: int | None):
    path, _, plain = tiny
    model = plain()
    apply_kernel_swaps(model)
    torch.manual_seed(0)
    model = trainable_model(model, JOB, None)
    if lora_b_seed is not None:  # a trained-like adapter: LoRA B away from its zero init
        g = torch.Generator().manual_seed(lora_b_seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _job_scores(model, tokenizer, rows) -> dict[str, float]:
    return evaluate_generation(model, tokenizer, rows, SPEC, 0, 1, lambda *v: list(v), seed=0, lockstep=False)


def test_step_zero_scores_are_the_base_models(tiny, rows_and_base):
    rows, base = rows_and_base
    want = _mean_scores(base, [r.reference for r in rows])
    assert 0.5 <= want["exact_match"] < 1  # the planted hits (two rows may share an answer), not every row
    assert _job_scores(_job_model(tiny, None), tiny[1], rows) == pytest.approx(want)


def test_scores_of_an_adapter_equal_transformers_generate_with_peft(tiny, rows_and_base, tmp_path):
    from peft import PeftModel

    _, tokenizer, plain = tiny
    rows, base = rows_and_base
    model = _job_model(tiny, lora_b_seed=1)
    got = _job_scores(model, tokenizer, rows)
    model.save_pretrained(str(tmp_path / "adapter"))
    reference = PeftModel.from_pretrained(plain(), str(tmp_path / "adapter")).eval()
    texts = _hf_answers(reference, tokenizer, [r.prompt_ids for r in rows])
    assert texts != base  # the adapter changes answers
    assert got == pytest.approx(_mean_scores(texts, [r.reference for r in rows]))


def test_metrics_follow_their_definitions():
    assert set(METRICS) == set(EVAL_METRICS)
    assert exact_match("The  Cat!", "cat") == 1.0 and exact_match("a dog", "cat") == 0.0
    assert token_f1("the cat sat", "cat sat down") == pytest.approx(2 * (1.0 * 2 / 3) / (1.0 + 2 / 3))
    assert METRICS["contains"]("so: Paris, France", "paris") == 1.0 and METRICS["regex"]("n=42", r"\d+") == 1.0
    from rouge_score import rouge_scorer
    import sacrebleu

    assert rouge_l("the cat sat", "the cat sat down") == rouge_scorer.RougeScorer(["rougeL"]).score(
        "the cat sat down", "the cat sat")["rougeL"].fmeasure
    assert chrf("the cat sat", "the cat sat down") == sacrebleu.sentence_chrf("the cat sat",
                                                                              ["the cat sat down"]).score / 100


def test_a_row_without_reference_is_refused_with_its_number(tiny, s3_bucket):
    _, tokenizer, _ = tiny
    uri = f"s3://{s3_bucket}/eval/bad.jsonl"
    storage.write_bytes(uri, b'{"messages": [{"role": "user", "content": "hi"}], "reference": "x"}\n'
                             b'{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(JobError) as failed:
        load_eval_rows(uri, tokenizer, ["exact_match"])
    assert failed.value.param == "evaluation.file" and "row 2" in failed.value.message
    storage.write_bytes(uri, b'{"messages": [{"role": "user", "content": "hi"}], "reference": "(x"}\n')
    assert load_eval_rows(uri, tokenizer, ["exact_match"])[0].reference == "(x"
    with pytest.raises(JobError, match="row 1: the reference is the regex metric's pattern"):
        load_eval_rows(uri, tokenizer, ["regex"])
