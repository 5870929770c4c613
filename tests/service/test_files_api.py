"""OpenAI's file flow and job fields, driven by the official `openai` package against a real control plane and
its S3 server: upload (rows checked), list, retrieve, download, delete; jobs that name the uploaded file by id,
`method` and `integrations`; events newest first with the SDK's pagination."""

from __future__ import annotations

import json

import boto3
import openai
import pytest

from tests.support.control_plane import TOKENS

ROWS = [{"text": f"row {i}"} for i in range(3)] + [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
JSONL = "\n".join(json.dumps(r) for r in ROWS).encode()


def _openai(service, tenant: str = "tenant-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key=TOKENS[tenant], max_retries=0)


def test_upload_list_download_delete(service):
    oa = _openai(service)
    uploaded = oa.files.create(file=("train.jsonl", JSONL), purpose="fine-tune")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(JSONL) and uploaded.filename == "train.jsonl"
    assert uploaded.purpose == "fine-tune" and uploaded.status == "processed"

    assert oa.files.retrieve(uploaded.id).bytes == len(JSONL)
    assert uploaded.id in [f.id for f in oa.files.list(purpose="fine-tune")]
    assert oa.files.content(uploaded.id).read() == JSONL
    # stored in the operator's bucket, in the tenant's folder
    key = f"files/tenant-a/{uploaded.id}.jsonl"
    s3 = boto3.client("s3", endpoint_url=service.app.state.settings.s3_endpoint_url)
    assert s3.get_object(Bucket="outputs", Key=key)["Body"].read() == JSONL

    with pytest.raises(openai.NotFoundError):  # another tenant's file is unknown
        _openai(service, "tenant-b").files.retrieve(uploaded.id)
    assert oa.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        oa.files.retrieve(uploaded.id)
    assert "Contents" not in s3.list_objects_v2(Bucket="outputs", Prefix=key)


@pytest.mark.parametrize(("body", "message"), [
    (b'{"text": "ok"}\n{"text": "fine"}\n{not json', "bad.jsonl row 3: not valid JSON"),
    (b'{"text": "ok"}\n{"messages": [{"role": "user", "content": "no answer"}]}', "row 2: 'messages' must contain"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},'
     b' {"role": "assistant", "content": "a cat"}]}', "row 1: 'messages[0].content[0].image_url.url' is a web URL"),
    (b"\n\n", "holds no rows"),
    (b"\xff\xfe", "is not UTF-8"),
])
def test_upload_refuses_a_bad_file_naming_the_row(service, body, message):
    with pytest.raises(openai.UnprocessableEntityError) as err:
        _openai(service).files.create(file=("bad.jsonl", body), purpose="fine-tune")
    error = err.value.body
    assert error["param"] == "file" and message in error["message"], error


def test_upload_refuses_other_purposes(service):
    with pytest.raises(openai.UnprocessableEntityError) as err:
        _openai(service).files.create(file=("x.jsonl", JSONL), purpose="assistants")
    assert err.value.body["param"] == "purpose"


def test_evaluation_files_upload_by_their_own_rules_and_jobs_name_them_by_id(service):
    """purpose "evaluation": rows are prompts with a reference (no assistant turn needed), checked on upload by the
    evaluation rules; `evaluation.file` takes the id, and a file of the other purpose is refused naming the field."""
    oa = _openai(service)
    prompt = [{"role": "user", "content": "2+2?"}]
    evaluation = oa.files.create(file=("eval.jsonl", json.dumps({"messages": prompt, "reference": "4"}).encode()),
                                 purpose="evaluation")
    assert evaluation.purpose == "evaluation" and evaluation.id in [f.id for f in oa.files.list(purpose="evaluation")]
    with pytest.raises(openai.UnprocessableEntityError) as err:
        oa.files.create(file=("eval.jsonl", json.dumps({"messages": prompt}).encode()), purpose="evaluation")
    assert err.value.body["message"] == ("file: eval.jsonl row 1: no reference: give 'reference' or end the messages "
                                         "with the assistant's answer")
    train = oa.files.create(file=("train.jsonl", JSONL), purpose="fine-tune")
    job = oa.fine_tuning.jobs.create(model="s3://models/tiny", training_file=train.id,
                                     extra_body={"evaluation": {"file": evaluation.id, "metrics": ["exact_match"]}})
    stored = service.store.get_job(job.id).spec["evaluation"]["file"]
    assert stored == f"s3://outputs/files/tenant-a/{evaluation.id}.jsonl"
    for field, body in (("training_file", {"training_file": evaluation.id}),
                        ("evaluation.file", {"training_file": train.id,
                                             "extra_body": {"evaluation": {"file": train.id, "metrics": ["rouge_l"]}}})):
        with pytest.raises(openai.UnprocessableEntityError) as err:
            oa.fine_tuning.jobs.create(model="s3://models/tiny", **body)
        assert err.value.body["param"] == field and "uploaded with purpose" in err.value.body["message"], field


def test_job_names_uploaded_files_method_and_integrations(service):
    oa = _openai(service)
    train = oa.files.create(file=("train.jsonl", JSONL), purpose="fine-tune")
    job = oa.fine_tuning.jobs.create(
        model="s3://models/tiny", training_file=train.id, validation_file=train.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3, "batch_size": 4}}},
        integrations=[{"type": "wandb", "wandb": {"project": "moe"}}],
    )
    stored = f"s3://outputs/files/tenant-a/{train.id}.jsonl"
    assert job.training_file == stored and job.validation_file == stored
    assert job.method.type == "supervised"
    assert job.method.supervised.hyperparameters.n_epochs == 3 and job.hyperparameters.batch_size == 4
    assert job.integrations[0].type == "wandb" and job.integrations[0].wandb.project == "moe"
    assert service.store.get_job(job.id).run_config["training"]["n_epochs"] == 3  # what the workers run

    with pytest.raises(openai.UnprocessableEntityError) as err:  # another tenant cannot train on it
        _openai(service, "tenant-b").fine_tuning.jobs.create(model="s3://models/tiny", training_file=train.id)
    assert err.value.body["param"] == "training_file"
    with pytest.raises(openai.UnprocessableEntityError) as err:
        oa.fine_tuning.jobs.create(model="s3://models/tiny", training_file=train.id,
                                   method={"type": "reinforcement", "reinforcement": {}})
    assert err.value.body["param"] == "method.type" and "not supported yet" in err.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as err:
        oa.fine_tuning.jobs.create(model="s3://models/tiny", training_file=train.id,
                                   integrations=[{"type": "comet", "comet": {}}])
    assert err.value.body["param"].startswith("integrations.0")
    with pytest.raises(openai.UnprocessableEntityError) as err:
        oa.fine_tuning.jobs.create(model="no-such-base", training_file=train.id)
    assert err.value.body["param"] == "model" and "GET /v1/models" in err.value.body["message"]


def test_events_are_newest_first_and_page_with_the_sdk(service):
    job_id = service.create_job()["id"]
    token = service.start_job(job_id)
    for step in (1, 2, 3):
        service.report(job_id, token, {"kind": "event", "type": "metrics", "message": f"Step {step}",
                                       "data": {"step": step}})
    oa = _openai(service)
    first = oa.fine_tuning.jobs.list_events(job_id, limit=2)
    assert [e.message for e in first.data] == ["Step 3", "Step 2"] and first.has_more
    assert [e.message for e in oa.fine_tuning.jobs.list_events(job_id, limit=2, after=first.data[-1].id).data] == [
        "Step 1", "Job started"]
    everything = [e.message for e in oa.fine_tuning.jobs.list_events(job_id, limit=2)]  # the SDK pages on
    assert everything == ["Step 3", "Step 2", "Step 1", "Job started", "Job queued", "Validating files",
                          "Job created"]
    # the moetune SDK's chronological view of the same list (wait, `moetune jobs events`)
    since = service.sdk().jobs.events_since(job_id, seen=first.data[-1].id)
    assert [e.message for e in since] == ["Step 3"]


def test_a_last_row_without_a_line_break_is_a_row(service):
    body = JSONL.rstrip(b"\n")
    uploaded = _openai(service).files.create(file=("last.jsonl", body), purpose="fine-tune")
    assert uploaded.bytes == len(body) and _openai(service).files.content(uploaded.id).read() == body
