"""The DPO method section (api/preference.py) and OpenAI's preference rows (api/data_rows.py): the knobs a job runs
with, and each bad row's problem naming its field."""

import json

import pytest
from pydantic import ValidationError

from moetune.api.data_rows import RowError, parse_rows, row_problem, training_row_problem
from moetune.api.models.base import SpecError
from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.api.preference import dpo_beta, method_type, method_view

ROW = {"input": {"messages": [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi?"}]},
       "preferred_output": [{"role": "assistant", "content": "hello."}],
       "non_preferred_output": [{"role": "assistant", "content": [{"type": "text", "text": "go away."}]}]}


def _job(**method) -> JobCreate:
    return JobCreate(model="s3://m/base", training_file="s3://d/train.jsonl", method=method)


def test_dpo_hyperparameters_map_onto_training_and_beta_defaults():
    spec = resolve_run_config(_job(type="dpo", dpo={"hyperparameters": {"beta": 0.3, "n_epochs": 2,
                                                                         "batch_size": 16}}), 0)
    assert spec.training.n_epochs == 2 and spec.training.global_batch_size == 16
    assert method_type(spec.method) == "dpo" and dpo_beta(spec.method.dpo) == 0.3
    assert dpo_beta(_job(type="dpo").method.dpo) == 0.1  # "auto"
    view = method_view(spec.method, {"batch_size": 16, "learning_rate_multiplier": 1.0, "n_epochs": 2})
    assert view == {"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 16, "learning_rate_multiplier": 1.0,
                                                               "n_epochs": 2, "beta": 0.3}}}
    assert method_view(None, {})["type"] == method_type(None) == "supervised"


def test_dpo_refusals_name_the_field():
    with pytest.raises(ValidationError, match="greater than 0"):
        _job(type="dpo", dpo={"hyperparameters": {"beta": 0}})
    with pytest.raises(ValidationError, match="gamma"):
        _job(type="dpo", dpo={"hyperparameters": {"gamma": 1}})
    with pytest.raises(SpecError) as err:  # which section's knobs apply would be a guess
        resolve_run_config(_job(type="supervised", dpo={"hyperparameters": {"beta": 0.2}}), 0)
    assert err.value.param == "method.dpo"
    with pytest.raises(SpecError) as err:
        resolve_run_config(_job(type="reinforcement"), 0)
    assert err.value.param == "method.type" and "supervised, dpo" in err.value.message


@pytest.mark.parametrize("change,problem", [
    ({"input": []}, "'input' must be an object with 'messages'"),
    ({"input": {"messages": []}}, "'input.messages' must be a non-empty list"),
    ({"input": {"messages": [{"role": "bot", "content": "x"}]}}, "'input.messages[0].role' must be one of"),
    ({"preferred_output": [{"role": "user", "content": "x"}]}, "'preferred_output[0].role' must be 'assistant'"),
    ({"non_preferred_output": [{"role": "assistant", "content": 3}]}, "'non_preferred_output[0].content' must be"),
    ({"input": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "s3://b/cat.png"}}]}]}},
     "'input.messages[0].content' has an image part; preference rows are text only"),
])
def test_a_bad_preference_row_names_its_field(change, problem):
    assert training_row_problem("dpo")({**ROW, **change}).startswith(problem)
    assert row_problem({**ROW, **change}).startswith(problem)  # the upload's rule: the same for a preference row


def test_an_upload_takes_both_kinds_and_a_job_only_its_own():
    text = "\n".join(json.dumps(r) for r in (ROW, {"messages": [{"role": "assistant", "content": "a"}]}))
    assert len(parse_rows(text)) == 2  # purpose fine-tune: either kind
    with pytest.raises(RowError) as err:
        parse_rows(text, problem=training_row_problem("dpo"))
    assert err.value.number == 2 and "'preferred_output'" in err.value.problem
    with pytest.raises(RowError) as err:
        parse_rows(text, problem=training_row_problem("supervised"))
    assert err.value.number == 1 and "method.type 'dpo'" in err.value.problem
    row = {k: v for k, v in ROW.items() if k != "non_preferred_output"}
    assert "'non_preferred_output'" in row_problem(row)
