"""The public job routes over real HTTP: create, validate, idempotency, list, retrieve, cancel, probes."""

import shutil

import boto3

import pytest

from moetune.api.models.responses import Job, JobStatus

JOBS = "/v1/fine_tuning/jobs"


def test_create_returns_an_openai_shaped_job(service):
    job = Job.model_validate(service.create_job(
        validation_file="s3://data/valid.jsonl", suffix="exp-1", metadata={"team": "nlp"}, priority=3,
        hyperparameters={"batch_size": 16, "learning_rate_multiplier": 2}))

    assert job.id.startswith("ftjob-") and len(job.id) == len("ftjob-") + 24
    assert job.status == JobStatus.validating_files and job.organization_id == "tenant-a"
    assert job.hyperparameters == {"batch_size": 16, "learning_rate_multiplier": 2.0, "n_epochs": 1}
    assert job.training.global_batch_size == 16 and job.training.learning_rate == pytest.approx(2e-4)
    assert job.output_uri == f"s3://outputs/runs/{job.id}"
    assert 0 <= job.seed < 2**31 and job.user_provided_suffix == "exp-1" and job.priority == 3
    events = service.http().get(f"{JOBS}/{job.id}/events").json()["data"]
    assert [e["message"] for e in events] == ["Validating files", "Job created"]  # newest first, as OpenAI's


def test_seed_and_output_uri_are_kept_when_given(service, s3_bucket):
    job = service.create_job(seed=7, output_uri=f"s3://{s3_bucket}/out/")
    assert job["seed"] == 7 and job["output_uri"] == f"s3://{s3_bucket}/out/{job['id']}"


def test_an_output_bucket_that_does_not_exist_is_422(service):
    reply = service.http().post(JOBS, json={"model": "s3://models/tiny", "training_file": "s3://data/t.jsonl",
                                            "output_uri": "s3://no-such-output-bucket/out"})
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "output_uri", reply.text


def test_a_model_folder_without_config_json_is_422(service, s3_endpoint, s3_bucket):
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key="no-config/model.safetensors",
                                                            Body=b"weights")
    reply = service.http().post(JOBS, json={"model": f"s3://{s3_bucket}/no-config",
                                            "training_file": "s3://data/t.jsonl"})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["param"] == "model" and "no config.json" in reply.json()["error"]["message"]


def test_what_storage_confirmed_is_remembered_and_what_it_refused_is_not(service, s3_endpoint, s3_bucket):
    """Submission remembers a model's config for seconds (a run of creates does not read it again) but never a
    missing one: a config.json uploaded after a refusal counts at once."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.put_object(Bucket=s3_bucket, Key="later/tokenizer.json", Body=b"{}")
    spec = {"model": f"s3://{s3_bucket}/later", "training_file": "s3://data/t.jsonl"}
    reply = service.http().post(JOBS, json=spec)
    assert reply.status_code == 422 and "no config.json" in reply.json()["error"]["message"], reply.text
    s3.put_object(Bucket=s3_bucket, Key="later/config.json", Body=b'{"model_type": "kimi_linear"}')
    assert service.http().post(JOBS, json=spec).status_code == 200
    s3.delete_object(Bucket=s3_bucket, Key="later/config.json")  # within the TTL: the driver's check catches it
    reply = service.http().post(JOBS, json=spec)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("fields, param", [
    ({"training": {"global_batch_size": 6, "micro_batch_size": 4}}, "training.global_batch_size"),
    ({"parallelism": {"num_workers": 4, "expert_parallel_size": 3}, "training": {"global_batch_size": 8}},
     "parallelism.expert_parallel_size"),
    # the layout's rules (api.models.parallelism.ParallelDims): sizes that cannot divide; what a layout does not run
    ({"parallelism": {"num_workers": 3, "expert_parallel_size": 2}, "training": {"global_batch_size": 6}},
     "parallelism.expert_parallel_size"),
    ({"parallelism": {"num_workers": 2, "context_parallel_size": 2}, "method": {"type": "dpo"}},
     "parallelism.context_parallel_size"),
    ({"parallelism": {"num_workers": 2, "context_parallel_size": 2}, "training": {"custom_kernels": False}},
     "training.custom_kernels"),
    ({"parallelism": {"num_workers": 2, "pipeline_parallel_size": 2}, "method": {"type": "dpo"}},
     "parallelism.pipeline_parallel_size"),
    ({"parallelism": {"num_workers": 2, "pipeline_parallel_size": 2},
      "evaluation": {"file": "s3://d/e.jsonl", "metrics": ["exact_match"]}}, "evaluation"),
    ({"parallelism": {"num_workers": 4, "pipeline_parallel_size": 2, "context_parallel_size": 2}},
     "parallelism.context_parallel_size"),
    ({"parallelism": {"num_workers": 2, "pipeline_parallel_size": 2},
      "training": {"global_batch_size": 2, "micro_batch_size": 2}}, "training.micro_batch_size"),
    ({"parallelism": {"num_workers": 2, "gpus_per_worker": 2}}, "parallelism.gpus_per_worker"),
    ({"model": "http://example.com/model"}, "model"),
    ({"training": {"micro_batch_size": 0}}, "training.micro_batch_size"),
    ({"lora": {"rank": 8, "unknown_knob": 1}}, "lora.unknown_knob"),
    ({"hyperparameters": {"batch_size": "lots"}}, "hyperparameters.batch_size"),
    ({"model": None}, "model"),
])
def test_invalid_specs_are_422_with_the_field_path(service, fields, param):
    response = service.http().post(JOBS, json={"model": "s3://m/x", "training_file": "s3://d/t.jsonl", **fields})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == param and error["message"]


def test_malformed_json_is_a_clear_422(service):
    response = service.http().post(JOBS, content=b"{nope", headers={"Content-Type": "application/json"})
    assert response.status_code == 422 and response.json()["error"]["message"] == "The request body is not valid JSON."


def test_idempotency_key_returns_the_same_job_or_409(service):
    http = service.http()
    body = {"model": "s3://m/x", "training_file": "s3://d/t.jsonl", "lora": {"rank": 8}}
    first = http.post(JOBS, json=body, headers={"Idempotency-Key": "run-42"})
    # Same request spelled differently (explicit default, other key order): still the same job.
    again = http.post(JOBS, json={"lora": {"rank": 8}, "priority": 0, **body}, headers={"Idempotency-Key": "run-42"})
    assert first.status_code == again.status_code == 200
    assert first.json()["id"] == again.json()["id"]

    changed = http.post(JOBS, json={**body, "lora": {"rank": 4}}, headers={"Idempotency-Key": "run-42"})
    assert changed.status_code == 409 and changed.json()["error"]["code"] == "idempotency_key_reused"
    other_tenant = service.http("tenant-b").post(JOBS, json=body, headers={"Idempotency-Key": "run-42"})
    assert other_tenant.status_code == 200 and other_tenant.json()["id"] != first.json()["id"]


def test_list_pages_newest_first_with_cursor(start_service):
    service = start_service()
    ids = [service.create_job()["id"] for _ in range(5)]
    http = service.http()

    page = http.get(JOBS, params={"limit": 2}).json()
    assert [j["id"] for j in page["data"]] == ids[:2:-1][:2] == [ids[4], ids[3]]
    assert page["has_more"] and page["last_id"] == ids[3]
    rest = http.get(JOBS, params={"limit": 100, "after": page["last_id"]}).json()
    assert [j["id"] for j in rest["data"]] == [ids[2], ids[1], ids[0]] and not rest["has_more"]
    assert http.get(JOBS).json()["object"] == "list"

    assert http.get(JOBS, params={"limit": 101}).json()["error"]["param"] == "limit"
    unknown = http.get(JOBS, params={"after": "ftjob-000000000000000000000000"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "after"


def test_unknown_job_is_404(service):
    response = service.http().get(f"{JOBS}/ftjob-does-not-exist")
    assert response.status_code == 404
    assert response.json() == {"error": {"code": "job_not_found", "param": None,
                                         "message": "No fine-tuning job with id 'ftjob-does-not-exist'."}}


def test_cancel_a_queued_job_then_cancelling_again_is_409(service):
    job = service.create_job()
    assert service.store.transition(job["id"], [JobStatus.validating_files], JobStatus.queued, "Job queued")
    http = service.http()

    cancelled = http.post(f"{JOBS}/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    again = http.post(f"{JOBS}/{job['id']}/cancel")
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_not_cancellable"
    messages = [e["message"] for e in http.get(f"{JOBS}/{job['id']}/events").json()["data"]]
    assert messages[:2] == ["Job cancelled", "Job queued"]


def test_a_finished_job_cannot_be_cancelled(service):
    job = service.create_job()
    token = service.start_job(job["id"])
    service.report(job["id"], token, {"kind": "result", "status": "succeeded", "fine_tuned_model": "s3://o/a"})
    response = service.http().post(f"{JOBS}/{job['id']}/cancel")
    assert response.status_code == 409 and response.json()["error"]["code"] == "job_not_cancellable"


def test_probes_and_schema(service):
    http = service.http(None)
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert {JOBS, f"{JOBS}/{{job_id}}", f"{JOBS}/{{job_id}}/cancel", f"{JOBS}/{{job_id}}/events",
            f"{JOBS}/{{job_id}}/checkpoints"} <= set(paths)
    assert not any(p.startswith("/internal") for p in paths)
    assert http.get("/no/such/route").json()["error"]["code"] == "not_found"


def test_readyz_is_503_when_the_database_is_gone(start_service, tmp_path):
    service = start_service(database_url=f"sqlite:///{tmp_path}/db/moetune.db")
    service.store.engine.dispose()
    shutil.rmtree(tmp_path / "db")  # SQLite cannot open (or re-create) a file in a missing directory
    response = service.http(None).get("/readyz")
    assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"


def test_an_internal_error_is_a_500_without_a_stack_trace(service):
    job_id = service.create_job()["id"]
    service.store.update_job(job_id, spec={"not": "a job spec"})  # a row this version cannot read
    response = service.http().get(f"{JOBS}/{job_id}")
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert "Traceback" not in response.text and "ValidationError" not in response.text
