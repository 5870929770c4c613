"""The scheduler against real parts: a moto S3 server for file checks, an unreachable Ray for resilience."""

import json
import time

import pytest

from bench.support.ray_jobs_api import RayJobsAPI
from moetune.api.environment import ENV_CALLBACK_URL, ENV_JOB_TOKEN, ENV_RUN_SPEC, ENV_S3_ENDPOINT_URL
from moetune.api.models.job_run import JobRunSpec
from moetune.service.cluster.scheduler import Scheduler, short_cause
from moetune.service.local.embedded import free_port
from moetune.service.quotas import TenantQuota, TenantUsage, wait_reason
from moetune.service.store import JobRow

JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture
def nowhere() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def status_of(service, job_id: str) -> dict:
    return service.http().get(f"{JOBS}/{job_id}").json()


@pytest.mark.parametrize("override, param", [
    ({"model": "s3://no-such-bucket-x2/model"}, "model"),  # a bucket storage cannot vouch for: accepted at create
    ({"training_file": "s3://{bucket}/missing.jsonl"}, "training_file"),
    ({"validation_file": "s3://no-such-bucket-x1/valid.jsonl"}, "validation_file"),
])
def test_missing_inputs_fail_the_job_with_the_field(start_service, s3_endpoint, s3_bucket, inputs, nowhere,
                                                    override, param):
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=nowhere)
    spec = {**inputs, **{k: v.format(bucket=s3_bucket) for k, v in override.items()}}
    job_id = service.create_job(**spec)["id"]

    Scheduler(service.store, service.app.state.settings).tick()

    job = status_of(service, job_id)
    assert job["status"] == "failed" and job["error"]["code"] == "file_not_found"
    assert job["error"]["param"] == param and spec[param] in job["error"]["message"]
    newest = service.http().get(f"{JOBS}/{job_id}/events").json()["data"][0]
    assert newest["level"] == "error" and newest["message"].startswith("Job failed: ")


def test_an_unreachable_ray_keeps_jobs_queued_and_they_can_be_cancelled(start_service, s3_endpoint, inputs,
                                                                         nowhere):
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=nowhere, scheduler_enabled=True,
                            scheduler_interval_s=0.05)
    job_id = service.create_job(**inputs)["id"]
    deadline = time.monotonic() + 15
    while status_of(service, job_id)["status"] == "validating_files" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # several ticks that each fail to reach Ray

    job = status_of(service, job_id)
    assert job["status"] == "queued" and job["queue_reason"].startswith(f"Ray is not reachable (the Ray Jobs API "
                                                                         f"at {nowhere} is not reachable")
    assert service.app.state.scheduler._thread.is_alive()
    assert service.http().post(f"{JOBS}/{job_id}/cancel").json()["status"] == "cancelled"
    messages = [e["message"] for e in service.http().get(f"{JOBS}/{job_id}/events").json()["data"]]
    # newest first; the reason once, however many ticks failed
    assert messages == ["Job cancelled", job["queue_reason"], "Job queued", "Validating files", "Job created"]
    assert _metric(service, 'moetune_dependency_errors_total{dependency="ray"}') >= 1


def _metric(service, series: str) -> float:
    line = next(line for line in service.http(None).get("/metrics").text.splitlines() if line.startswith(series))
    return float(line.rsplit(" ", 1)[1])


def test_unreachable_storage_keeps_jobs_validating_with_one_event_and_readyz_names_it(start_service, nowhere):
    service = start_service(s3_endpoint_url=nowhere, ray_address=nowhere)
    job_id = service.create_job()["id"]
    scheduler = Scheduler(service.store, service.app.state.settings,
                          on_dependency_error=service.app.state.scheduler.on_dependency_error)
    for _ in range(3):  # the first fails, the next two wait for the backoff
        scheduler.tick()

    job = status_of(service, job_id)
    assert job["status"] == "validating_files" and job["queue_reason"].startswith("Object storage is not reachable")
    events = service.http().get(f"{JOBS}/{job_id}/events").json()["data"]
    assert [e["message"] for e in events] == [job["queue_reason"], "Validating files", "Job created"]
    assert events[0]["level"] == "warn"
    assert _metric(service, 'moetune_dependency_errors_total{dependency="storage"}') == 1
    ready = service.http(None).get("/readyz")
    assert ready.status_code == 503 and ready.json()["error"]["message"] == "Not ready: storage not reachable."


def _ray_reports_nodes(scheduler: Scheduler) -> None:
    deadline = time.monotonic() + 30
    while not scheduler.ray.cluster_nodes():  # a fresh head's monitor reports after a few seconds
        assert time.monotonic() < deadline, "the Ray head reported no node"
        time.sleep(0.5)


@pytest.mark.parametrize("parallelism, param, cause", [
    ({"gpus_per_worker": 1}, "parallelism.gpus_per_worker", "no node of the Ray cluster has more than 0 GPU"),
    ({"num_workers": 1000}, "parallelism.num_workers", "1000 workers need 1000 CPU"),
])
def test_a_job_no_node_can_hold_fails_before_submission(start_service, s3_endpoint, inputs, ray_head,
                                                       parallelism, param, cause):
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=ray_head.dashboard_url, unschedulable_grace_s=0)
    job_id = service.create_job(**inputs, parallelism=parallelism,
                                training={"global_batch_size": 1000})["id"]
    scheduler = Scheduler(service.store, service.app.state.settings)
    _ray_reports_nodes(scheduler)
    scheduler.validate_files()
    scheduler.submit_queued()

    job = status_of(service, job_id)
    assert job["status"] == "failed" and job["error"]["code"] == "unschedulable"
    assert job["error"]["param"] == param and cause in job["error"]["message"]
    assert service.store.get_job(job_id).ray_submission_id is None  # Ray never saw it


def test_a_job_the_busy_cluster_cannot_hold_now_waits_queued_with_its_reason(start_service, s3_endpoint, inputs,
                                                                             ray_head):
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=ray_head.dashboard_url, max_running_jobs=3)
    running = service.create_job(**inputs, parallelism={"num_workers": 4})["id"]  # the head's 4 CPUs
    service.start_job(running)
    waiting = service.create_job(**inputs, parallelism={"num_workers": 2})["id"]
    scheduler = Scheduler(service.store, service.app.state.settings)
    _ray_reports_nodes(scheduler)
    scheduler.validate_files()
    scheduler.submit_queued()
    scheduler.submit_queued()

    job = status_of(service, waiting)
    assert job["status"] == "queued" and service.store.get_job(waiting).ray_submission_id is None
    assert job["queue_reason"] == "waiting for cluster resources: 2 workers need 2 CPU, 0 CPU free now"
    messages = [e["message"] for e in service.http().get(f"{JOBS}/{waiting}/events").json()["data"]]
    assert messages.count(job["queue_reason"]) == 1


def test_a_job_waiting_for_a_slot_says_so(start_service, s3_endpoint, inputs, nowhere):
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=nowhere, max_running_jobs=1)
    service.start_job(service.create_job(**inputs)["id"])
    waiting = service.create_job(**inputs)["id"]
    scheduler = Scheduler(service.store, service.app.state.settings)
    scheduler.validate_files()
    scheduler.submit_queued()
    assert status_of(service, waiting)["queue_reason"] == "waiting for a running slot (1 jobs running, " \
                                                          "max_running_jobs=1)"


def test_ray_jobs_get_the_run_spec_and_passthrough_env(start_service, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    service = start_service(s3_endpoint_url="http://s3.local:9000", callback_url="http://cp:8000")
    job_id = service.create_job(seed=11)["id"]

    env = Scheduler(service.store, service.app.state.settings).job_env(service.store.get_job(job_id), "secret")

    run_spec = JobRunSpec.model_validate(json.loads(env[ENV_RUN_SPEC]))
    assert run_spec.job_id == job_id and run_spec.config.seed == 11
    assert run_spec.output_uri == f"s3://outputs/runs/{job_id}" and run_spec.config.training.n_epochs == 1
    assert env[ENV_CALLBACK_URL] == "http://cp:8000" and env[ENV_JOB_TOKEN] == "secret"
    assert env[ENV_S3_ENDPOINT_URL] == "http://s3.local:9000"
    assert env["HF_HUB_OFFLINE"] == "1" and "AWS_SESSION_TOKEN" not in env


def test_ray_failure_messages_are_shortened_to_the_cause():
    message = ("Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
               "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad rank\n")
    assert short_cause(message) == "Job entrypoint command failed with exit code 1 (ValueError: bad rank)"
    assert short_cause("Job was intentionally stopped.") == "Job was intentionally stopped"
    assert short_cause(None) == "the Ray job ended without a message"


def test_settings_read_the_environment(monkeypatch):
    from moetune.service.settings import Settings

    monkeypatch.setenv("MOETUNE_API_TOKENS", "t1:alpha, t2:beta")
    monkeypatch.setenv("MOETUNE_WORKER_ENV_PASSTHROUGH", "A,B")
    monkeypatch.setenv("MOETUNE_MAX_RUNNING_JOBS", "5")
    settings = Settings()
    assert settings.tenants_by_token == {"t1": "alpha", "t2": "beta"}
    assert settings.worker_env_passthrough == ["A", "B"] and settings.max_running_jobs == 5

    monkeypatch.setenv("MOETUNE_API_TOKENS", "no-tenant-here")
    with pytest.raises(ValueError, match="entry 1"):
        Settings()


@pytest.fixture
def ray_api():
    api = RayJobsAPI()
    yield api
    api.close()


def _run_pass(service) -> Scheduler:
    scheduler = Scheduler(service.store, service.app.state.settings)
    scheduler.validate_files()
    scheduler.submit_queued()
    return scheduler


def test_tenants_take_turns_within_a_priority(start_service, s3_endpoint, inputs, ray_api):
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=ray_api.url, max_running_jobs=3)
    crowd = [service.create_job(**inputs)["id"] for _ in range(4)]
    single = service.create_job("tenant-b", **inputs)["id"]
    urgent = service.create_job(**inputs, priority=5)["id"]
    _run_pass(service)
    running = {j for j in [*crowd, single, urgent] if service.store.get_job(j).status == "running"}
    assert running == {urgent, crowd[0], single}  # not tenant-a's four before tenant-b's one


def test_tenant_quotas_refuse_wait_and_show_usage(start_service, s3_endpoint, inputs, ray_api):
    quotas = {"tenant-a": {"max_running_jobs": 1, "max_workers": 2, "gpu_hours": 1}, "*": {"gpu_hours": 10}}
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=ray_api.url, max_running_jobs=10,
                            tenant_quotas=quotas)
    a = service.http("tenant-a")
    too_wide = a.post(JOBS, json={**inputs, "parallelism": {"num_workers": 3}, "training": {"global_batch_size": 6}})
    assert too_wide.status_code == 422 and too_wide.json()["error"]["param"] == "parallelism.num_workers"
    assert "quota max_workers=2" in too_wide.json()["error"]["message"]

    first, second = (service.create_job(**inputs)["id"] for _ in range(2))
    gpu_job = service.create_job("tenant-b", **inputs, parallelism={"num_workers": 2, "gpus_per_worker": 1})["id"]
    _run_pass(service)
    assert service.store.get_job(first).status == service.store.get_job(gpu_job).status == "running"
    waiting = status_of(service, second)
    assert waiting["status"] == "queued" and waiting["queue_reason"] == (
        "waiting for one of tenant tenant-a's 1 running jobs to end (its quota max_running_jobs=1)")

    # a run's GPU time is counted when it ends: 2 GPUs for a quarter of an hour
    service.store.update_job(gpu_job, started_at=time.time() - 900)
    assert service.http("tenant-b").post(f"{JOBS}/{gpu_job}/cancel").status_code == 200
    assert service.store.get_job(gpu_job).gpu_seconds == pytest.approx(1800, abs=5)

    service.store.update_job(first, gpu_seconds=3600.0)  # tenant-a's budget is spent
    spent = a.post(JOBS, json={**inputs, "parallelism": {"gpus_per_worker": 1}})
    assert spent.status_code == 429 and spent.json()["error"]["code"] == "quota_exceeded"
    assert "tenant tenant-a has used 1.00 of its 1 GPU-hour budget" in spent.json()["error"]["message"]
    assert a.post(JOBS, json=inputs).status_code == 200  # a CPU job uses no GPU-hours

    metrics = service.http(None).get("/metrics").text
    for series in ('moetune_tenant_running_jobs{tenant="tenant-a"} 1.0', 'moetune_tenant_workers{tenant="tenant-a"} 1.0',
                   'moetune_tenant_gpu_hours{tenant="tenant-b"} 0.5', 'moetune_tenant_quota{limit="gpu_hours",tenant="*"} 10.0',
                   'moetune_tenant_quota{limit="max_workers",tenant="tenant-a"} 2.0', "moetune_scheduler_leader 0.0"):
        assert series in metrics, series


def test_a_tenant_over_its_worker_quota_waits_with_the_numbers():
    job = JobRow(tenant="t", gpus=0, spec={"parallelism": {"num_workers": 3}})
    usage = {"t": TenantUsage(running_jobs=1, workers=2)}
    assert wait_reason({"t": TenantQuota(max_workers=4)}, usage, job) == (
        "waiting for tenant t's jobs to free workers (2 in use, this job needs 3, its quota max_workers=4)")
    assert wait_reason({"*": TenantQuota(max_workers=5)}, usage, job) is None


def test_a_job_no_node_can_hold_waits_while_the_nodes_change_then_fails(start_service, s3_endpoint, inputs, ray_api):
    """Ray's resource report lags a node that just joined: a job the report says no node can hold waits, with its
    reason, until the nodes held still for unschedulable_grace_s, and starts if a node joins meanwhile."""
    grace = 1.0
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=ray_api.url, max_running_jobs=3,
                            unschedulable_grace_s=grace)
    ray_api.usage_by_node = {"head": {"CPU": [0.0, 1.0]}}
    two = service.create_job(**inputs, parallelism={"num_workers": 2}, priority=1)["id"]
    three = service.create_job(**inputs, parallelism={"num_workers": 3}, training={"global_batch_size": 3})["id"]
    scheduler = _run_pass(service)
    job = status_of(service, two)
    assert job["status"] == "queued" and job["queue_reason"].endswith(
        "the Ray cluster's nodes changed less than 1 s ago, so the job waits for them to settle before it fails")
    assert "2 workers need 2 CPU" in job["queue_reason"]
    time.sleep(grace)
    ray_api.usage_by_node["worker1"] = {"CPU": [0.0, 1.0]}  # a node joined within the grace: the job starts
    scheduler.submit_queued()
    assert service.store.get_job(two).status == "running"
    assert status_of(service, three)["status"] == "queued"  # 3 workers on 2 nodes: the nodes just changed
    time.sleep(grace)  # the nodes held still: it can never start
    scheduler.submit_queued()
    job = status_of(service, three)
    assert job["status"] == "failed" and job["error"]["code"] == "unschedulable", job


def test_the_default_lease_replaces_a_lost_leader_within_15_s():
    from moetune.service.settings import Settings

    settings = Settings()
    assert settings.scheduler_lease_s + settings.scheduler_lease_renew_s + settings.scheduler_interval_s < 15
    with pytest.raises(ValueError, match="scheduler_lease_renew_s must be > 0 and below scheduler_lease_s"):
        Settings(scheduler_lease_s=3, scheduler_lease_renew_s=3)


def test_a_job_whose_supervisor_died_with_a_fault_tolerant_head_is_requeued(start_service, s3_endpoint, inputs,
                                                                            ray_api):
    """A head restarted on its state in Redis (GCS fault tolerance) still knows the submission, but fails it: its
    supervisor and driver died with the old head. That is the head's loss: the job goes back to the queue as its
    next attempt (resuming from its newest checkpoint); a driver's own failure still fails its job. The supervisors
    are listed once per pass, not once per running job."""
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=ray_api.url, max_running_jobs=4)
    lost, stale, failing, healthy = (service.create_job(**inputs)["id"] for _ in range(4))
    scheduler = _run_pass(service)
    ray_api.end(f"moetune-{lost}-1", error_type="JOB_SUPERVISOR_ACTOR_DIED")
    # still RUNNING to Ray (its job manager has not looked again since the head came back), supervisor DEAD
    ray_api.dead_supervisors.add(f"_ray_internal_job_actor_moetune-{stale}-1")
    ray_api.end(f"moetune-{failing}-1", error_type="JOB_ENTRYPOINT_COMMAND_ERROR")
    lists = ray_api.actor_lists
    scheduler.follow_running()
    assert ray_api.actor_lists == lists + 1
    assert service.store.get_job(healthy).status == "running"  # its supervisor is alive
    for job_id in (lost, stale):
        row = service.store.get_job(job_id)
        assert (row.status, row.attempt) == ("queued", 2)
        assert service.sdk().jobs.events_since(job_id)[-1].message.startswith(
            f"Job requeued: Ray lost the supervisor of job moetune-{job_id}-1 with its head")
    assert service.store.get_job(failing).status == "failed"
    scheduler.submit_queued()
    assert service.store.get_job(lost).ray_submission_id == f"moetune-{lost}-2"
