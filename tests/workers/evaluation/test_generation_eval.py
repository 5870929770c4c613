"""The evaluation metrics and rows. That a job's scores equal transformers' greedy `generate` answers scored the same
way (the base model's at step 0, the exported adapter's through PEFT) is proven on a real EP=2 job in
tests/workers/reporting/test_job_metrics.py."""

from __future__ import annotations

import json

import pytest

from moetune.api import storage
from moetune.api.models.training import EVAL_METRICS
from moetune.workers.errors import JobError
from moetune.workers.evaluation.generation import load_eval_rows, prompt_ids
from moetune.workers.evaluation.metrics import METRICS, chrf, exact_match, rouge_l, token_f1
from moetune.workers.tiny import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tokenizer"))
    write_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


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


def test_rows_give_prompt_and_reference_and_bad_rows_are_refused_with_their_number(tokenizer, s3_bucket):
    uri = f"s3://{s3_bucket}/eval/rows.jsonl"
    ask, answer = [{"role": "user", "content": "hi"}], {"role": "assistant", "content": "yo"}
    storage.write_bytes(uri, (json.dumps({"messages": [*ask, answer]}) + "\n"
                              + json.dumps({"messages": ask, "reference": "x"}) + "\n").encode())
    rows = load_eval_rows(uri, tokenizer, ["exact_match"])
    assert [r.reference for r in rows] == ["yo", "x"]  # the final assistant turn, else "reference"
    assert rows[0].prompt_ids == rows[1].prompt_ids == prompt_ids(tokenizer, ask)  # the answer is not prompted
    prompt = tokenizer.decode(rows[0].prompt_ids)
    assert "hi" in prompt and "yo" not in prompt
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
