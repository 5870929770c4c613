"""The training-session routes without a worker group: refusals, a control plane whose Ray is down, tenant quotas,
and the recovery of a failed group against a stand-in of Ray's Jobs API, the group's side played by the test (the
end-to-end session, with a real worker killed, is tests/e2e/test_training_sessions.py); the CLI's view of them."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import update

from bench.support.ray_jobs_api import RayJobsAPI
from bench.support.waiting import wait_for
from moetune.api.environment import ENV_JOB_TOKEN, ENV_RUN_SPEC
from moetune.api.models.training_sessions import SESSION_INTERNAL, SessionRunSpec
from moetune.api.training import CallFailed, Training
from moetune.service import quotas
from moetune.service.cli.main import main
from moetune.service.local.embedded import free_port
from moetune.service.quotas import usage_by_tenant, wait_reason
from moetune.service.sessions import records
from moetune.service.store import CallRow, JobRow
from tests.support.control_plane import TOKENS

SESSIONS = "/v1/training_sessions"
SPEC = {"model": "s3://b/m", "lora": {"rank": 4}, "parallelism": {"num_workers": 2}}


def test_refusals_name_the_field_and_a_session_ray_never_took_is_failed(start_service):
    service = start_service(ray_address=f"http://127.0.0.1:{free_port()}")
    with service.http() as http:
        unknown = http.post("/v1/training_sessions", json={"model": "no-such-base"})
        assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "model"
        for layout, param in (({"num_workers": 3, "expert_parallel_size": 2}, "parallelism.expert_parallel_size"),
                              ({"num_workers": 2, "context_parallel_size": 2}, "parallelism.context_parallel_size"),
                              ({"num_workers": 2, "pipeline_parallel_size": 2}, "parallelism.pipeline_parallel_size")):
            uneven = http.post("/v1/training_sessions", json={"model": "s3://b/m", "parallelism": layout})
            assert uneven.status_code == 422 and uneven.json()["error"]["param"] == param, uneven.text
        down = http.post("/v1/training_sessions", json={"model": "s3://b/m", "lora": {"rank": 4}})
        assert down.status_code == 503 and "not started" in down.json()["error"]["message"]
        (session,) = http.get("/v1/training_sessions").json()["data"]
        assert session["status"] == "failed" and session["error"]["code"] == "driver_failed"
        calls = f"/v1/training_sessions/{session['id']}/calls"
        no_advantages = http.post(calls, json={"call": {"kind": "forward_backward", "loss_fn": "ppo",
                                                        "data": [{"tokens": [1, 2, 3]}]}})
        assert no_advantages.status_code == 422
        assert "data[0].advantages is required" in no_advantages.json()["error"]["message"]
        misaligned = http.post(calls, json={"call": {"kind": "forward_backward",
                                                     "data": [{"tokens": [1, 2, 3], "weights": [1.0]}]}})
        assert misaligned.status_code == 422 and "one per token" in misaligned.json()["error"]["message"]
        forward = http.post(calls, json={"call": {"kind": "forward", "data": [{"tokens": [1, 2], "logprobs": [0.0]}]}})
        assert forward.status_code == 422 and forward.json()["error"]["param"] == "call.forward.data.0"
        assert "logprobs has 1 entries, tokens 2" in forward.json()["error"]["message"]
        empty_stop = http.post(calls, json={"call": {"kind": "sample", "prompts": ["ab"], "stop": ["\n\n", ""]}})
        assert empty_stop.status_code == 422 and empty_stop.json()["error"]["param"] == "call.sample.stop"
        assert "stop[1] is ''" in empty_stop.json()["error"]["message"]
        elsewhere = http.post(calls, json={"call": {"kind": "load_state", "name": "s", "uri": "s3://other/states/s"}})
        assert elsewhere.status_code == 422 and elsewhere.json()["error"]["param"] == "call.uri"
        closed = http.post(calls, json={"call": {"kind": "optim_step"}})
        assert closed.status_code == 409 and closed.json()["error"]["code"] == "session_not_open"
        assert http.get("/v1/training_sessions/ts_nope").status_code == 404
        with service.http("tenant-b") as other:
            assert other.get(f"/v1/training_sessions/{session['id']}").status_code == 404
        metrics = http.get("/metrics").text
    assert re.search(r'moetune_training_sessions\{status="failed"\} 1\.0', metrics)
    cli = CliRunner(env={"MOETUNE_URL": service.url, "MOETUNE_TOKEN": TOKENS["tenant-a"]})
    listed = cli.invoke(main, ["sessions", "list"], catch_exceptions=False)
    assert session["id"] in listed.output and "failed" in listed.output
    shown = cli.invoke(main, ["sessions", "get", session["id"]], catch_exceptions=False)
    assert "not reachable" in shown.output
    refused = cli.invoke(main, ["sessions", "close", session["id"]])
    assert refused.exit_code == 1 and "409 session_not_open" in refused.output


def test_a_session_outlives_a_ray_outage_and_its_restart_and_close_wait_for_ray(start_service):
    """Ray goes down (the Jobs API's port closes) under an open session: reading it keeps it open, restart and
    close are retryable 503s that change nothing, and once Ray answers again both work."""
    ray = RayJobsAPI()
    port = int(ray.url.rsplit(":", 1)[1])
    service = start_service(ray_address=ray.url)
    with service.http() as http:
        session = http.post("/v1/training_sessions", json={"model": "s3://b/m", "lora": {"rank": 4}}).json()
        assert session["status"] == "starting"
        ray.close()
        path = f"/v1/training_sessions/{session['id']}"
        assert http.get(path).json()["status"] == "starting"
        for action in ("restart", "close"):
            refused = http.post(f"{path}/{action}")
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "5", refused.text
            assert "not reachable" in refused.json()["error"]["message"]
            kept = http.get(path).json()
            assert (kept["status"], kept["restarts"]) == ("starting", 0)
        ray = RayJobsAPI(port=port)
        try:
            # as a client honouring Retry-After does: the control plane asks Ray again once its backoff ran out
            restarted = wait_for(lambda: (r := http.post(f"{path}/restart")).status_code != 503 and r, 15,
                                 "a restart once Ray answers again", interval=0.5)
            assert restarted.status_code == 200 and restarted.json()["restarts"] == 1, restarted.text
            assert ray.submitters(f"moetune-{session['id']}-1")
            assert http.post(f"{path}/close").json()["status"] == "closed"
            # the head that came back never knew group 0 (a restarted head forgets its jobs): only group 1 stopped
            assert ray.stopped == [f"moetune-{session['id']}-1"]
        finally:
            ray.close()


def test_open_sessions_count_against_the_tenant_quota(start_service):
    """An open session is a running job of its tenant: it holds its workers (and GPUs, whose time counts against
    the budget until it closes); one that does not fit now is a 429 (sessions do not queue), and a job waits."""
    ray = RayJobsAPI()
    service = start_service(ray_address=ray.url, tenant_quotas={
        "tenant-a": {"max_running_jobs": 1, "max_workers": 2}, "tenant-b": {"gpu_hours": 0.5}})
    try:
        with service.http() as a, service.http("tenant-b") as b:
            wide = a.post(SESSIONS, json={**SPEC, "parallelism": {"num_workers": 3}})
            assert wide.status_code == 422 and wide.json()["error"]["param"] == "parallelism.num_workers"
            first = a.post(SESSIONS, json=SPEC).json()
            refused = a.post(SESSIONS, json=SPEC)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded"
            assert ("one of tenant tenant-a's 1 running jobs (1 of them training sessions) to end (its quota "
                    "max_running_jobs=1)") in refused.json()["error"]["message"]
            usage = usage_by_tenant(service.store, [], time.time())  # the scheduler's view: a job of tenant-a waits
            job = JobRow(tenant="tenant-a", gpus=0, spec={"parallelism": {"num_workers": 1}})
            assert wait_reason(service.app.state.settings.tenant_quotas, usage, job) == (
                "waiting for one of tenant tenant-a's 1 running jobs (1 of them training sessions) to end (its "
                "quota max_running_jobs=1)")

            gpu = b.post(SESSIONS, json={**SPEC, "parallelism": {"num_workers": 2, "gpus_per_worker": 1}}).json()
            records.set_session(service.store, gpu["id"], ("starting",), created_at=time.time() - 900)
            metrics = service.http(None).get("/metrics").text
            for series in ('moetune_tenant_running_jobs{tenant="tenant-a"} 1.0',
                           'moetune_tenant_training_sessions{tenant="tenant-a"} 1.0',
                           'moetune_tenant_workers{tenant="tenant-a"} 2.0',
                           'moetune_tenant_workers{tenant="tenant-b"} 2.0'):
                assert series in metrics, series
            assert re.search(r'moetune_tenant_gpu_hours\{tenant="tenant-b"\} 0\.50', metrics)

            assert a.post(f"{SESSIONS}/{first['id']}/close").json()["status"] == "closed"
            assert a.post(SESSIONS, json=SPEC).status_code == 200  # the closed session freed its place
            assert b.post(f"{SESSIONS}/{gpu['id']}/close").status_code == 200  # 2 GPUs for a quarter of an hour
            assert records.get_session(service.store, gpu["id"]).gpu_seconds == pytest.approx(1800, abs=5)
            spent = b.post(SESSIONS, json={**SPEC, "parallelism": {"num_workers": 1, "gpus_per_worker": 1}})
            assert spent.status_code == 429 and "has used 0.50 of its 0.5 GPU-hour budget" in spent.text
            assert b.post(SESSIONS, json=SPEC).status_code == 200  # a CPU session uses no GPU-hours
    finally:
        ray.close()


def test_two_creates_at_once_cannot_both_take_the_last_place(start_service, monkeypatch):
    """A create checks what is held, then inserts its session. The check is slowed here (a sleep: the race cannot be
    timed otherwise) so that, were the two not one step, the second create's check would run before the first's
    insert. Of two creates at once against a tenant quota of one, and of two against the cluster's last running
    slot (max_running_jobs counts open sessions), one is a 429; a queued job waits for a slot the sessions hold."""
    ray = RayJobsAPI()
    service = start_service(ray_address=ray.url, max_running_jobs=2,
                            tenant_quotas={"tenant-a": {"max_running_jobs": 1}})
    counted = quotas.usage_by_tenant

    def slow_usage(*args):
        usage = counted(*args)
        time.sleep(0.3)
        return usage

    monkeypatch.setattr(quotas, "usage_by_tenant", slow_usage)

    def create_twice(tenant: str) -> list[httpx.Response]:
        with service.http(tenant) as first, service.http(tenant) as second, ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda http: http.post(SESSIONS, json=SPEC), (first, second)))
        return sorted(answers, key=lambda r: r.status_code)

    try:
        taken, refused = create_twice("tenant-a")
        assert (taken.status_code, refused.status_code) == (200, 429), refused.text
        assert "its quota max_running_jobs=1" in refused.json()["error"]["message"]
        taken, refused = create_twice("tenant-b")
        assert (taken.status_code, refused.status_code) == (200, 429), refused.text
        full = "a running slot (0 jobs running and 2 training sessions open, max_running_jobs=2)"
        assert f"wait for {full}" in refused.json()["error"]["message"]
        job = service.store.create_job(JobRow(id="ftjob-behind-sessions", tenant="tenant-b", status="queued",
                                              spec={}, seed=1, output_uri="s3://b/o"), [])
        service.app.state.scheduler.submit_queued()  # one pass (the tests' control planes do not schedule alone)
        assert service.store.get_job(job.id).queue_reason == f"waiting for {full}"
    finally:
        ray.close()


def _group(service, ray: RayJobsAPI, session_id: str, attempt: int) -> tuple[httpx.Client, SessionRunSpec]:
    """The side of the session's group `attempt` (its chief's calls), with the token and run spec Ray was given."""
    env = ray.env_vars[f"moetune-{session_id}-{attempt}"]
    client = httpx.Client(base_url=service.url + SESSION_INTERNAL.format(session_id=session_id), timeout=10,
                          params={"attempt": attempt}, headers={"Authorization": f"Bearer {env[ENV_JOB_TOKEN]}"})
    return client, SessionRunSpec.model_validate_json(env[ENV_RUN_SPEC])


def _run_next(group: httpx.Client, result: dict | None = None) -> None:
    (call,) = group.post("/next_call", json={"wait_s": 0}).json()["calls"]
    if result is not None:
        assert group.post(f"/calls/{call['call_id']}", json={"result": result}).status_code == 200


def test_a_failed_group_is_replaced_from_the_newest_state_and_the_sdk_says_so(start_service):
    """Control-plane level (the Ray Jobs API a stand-in, the group played by the test): the driver reports its
    group failed; a new group is submitted that restores the newest saved state, and the calls the old one left
    fail as session_restarted with that state's step. The user's restart resumes from it too. The next loss, a
    driver that vanished (its Ray job ended without a word) and max_recoveries spent, fail the session with the
    cause."""
    ray = RayJobsAPI()
    service = start_service(ray_address=ray.url)
    try:
        session = Training(service.sdk()).create({**SPEC, "max_recoveries": 1})
        group, run = _group(service, ray, session.id, 0)
        assert run.restore is None and group.post("/ready").status_code == 200
        for name, step in (("s1", 3), ("s2", 5)):
            session.save_state(name)
            _run_next(group, {"uri": f"s3://b/{name}", "step": step})
        running = session.forward_backward([{"tokens": [1, 2, 3]}])
        queued = session.optim_step()
        _run_next(group)  # taken, never finished: the group dies under it
        ray.submit_delay_s = 2.0  # a slow head: the user looks while the new group's submission is in flight

        def look_in_flight():
            """A look (which asks Ray after the group) once the recovery began, before Ray knew the new group: not
            a lost group (it failed the session in a loaded run, polled by the SDK's wait_ready)."""
            in_flight = f"moetune-{session.id}-1" not in ray.entrypoints
            info = session.retrieve()
            return in_flight and info.restarts == 1 and info

        with ThreadPoolExecutor(1) as pool:
            failed = pool.submit(group.post, "/ended", json={"reason": "failed", "error": {
                "code": "session_failed", "message": "WorkerGroupError: a worker died"}})
            info = wait_for(look_in_flight, 10, "a look at the session while its new group is submitted")
            assert (info.status, info.recoveries) == ("starting", 1)
            assert failed.result().status_code == 200
        ray.submit_delay_s = 0.0

        info = session.retrieve()
        assert (info.status, info.restarts, info.recoveries) == ("starting", 1, 1)
        new_group, run = _group(service, ray, session.id, 1)
        assert run.restore == "s2"
        for future in (running, queued):
            with pytest.raises(CallFailed) as lost:
                future.result(timeout=5)
            assert (lost.value.restarted, lost.value.restored_state, lost.value.restored_step) == (True, "s2", 5)
        assert "WorkerGroupError: a worker died" in str(lost.value) and "state 's2' (step 5)" in str(lost.value)
        assert group.post("/next_call", json={"wait_s": 0}).status_code == 409  # the dead group is locked out

        assert new_group.post("/ready").status_code == 200
        for uri in ("s3://b/ts/weights/w/7", "s3://b/ts/weights/w/8"):  # two saves under one name
            session.save_weights("w")
            _run_next(new_group, {"uri": uri})
        (served,) = [m["id"] for m in service.http().get("/v1/models").json()["data"] if m["id"].startswith("ft:")]
        model = service.http().get(f"/v1/models/{served}").json()  # what a Serve replica loads
        assert model["moetune"]["adapter_uri"] == "s3://b/ts/weights/w/8"  # the name's newest save
        running = session.forward_backward([{"tokens": [1, 2, 3]}])
        _run_next(new_group)
        assert session.restart().restarts == 2  # the user's restart resumes alike, not from a fresh LoRA
        assert ray.stopped == [f"moetune-{session.id}-1"] and _group(service, ray, session.id, 2)[1].restore == "s2"
        with pytest.raises(CallFailed) as lost:
            running.result(timeout=5)
        assert (lost.value.restarted, lost.value.restored_state, lost.value.restored_step) == (True, "s2", 5)
        assert "the new one resumes from state 's2' (step 5)" in str(lost.value)

        assert _group(service, ray, session.id, 2)[0].post("/ready").status_code == 200
        ray.end(f"moetune-{session.id}-2")  # its driver killed: nothing reported, Ray says FAILED
        info = session.retrieve()
        assert (info.status, info.recoveries, info.error.code) == ("failed", 1, "driver_failed")
        assert "session's Ray job ended (FAILED)" in info.error.message
        assert f"moetune-{session.id}-3" not in ray.entrypoints
    finally:
        ray.close()


def test_a_fresh_restart_starts_a_new_lora_and_later_recoveries_do_not_resume_the_old_one(start_service):
    """restart(fresh=True): the new group loads no state, and the answer, the call it cut short and the session's
    view say so; a later recovery resumes from what was saved since, not from the states of the LoRA before."""
    ray = RayJobsAPI()
    service = start_service(ray_address=ray.url)
    try:
        session = Training(service.sdk()).create({**SPEC, "max_recoveries": 2})
        group, _ = _group(service, ray, session.id, 0)
        assert group.post("/ready").status_code == 200
        session.save_state("s1")
        _run_next(group, {"uri": "s3://b/s1", "step": 3})
        assert (session.restart().restored_state, session.info.restored_step) == ("s1", 3)  # the default
        group, run = _group(service, ray, session.id, 1)
        assert run.restore == "s1" and group.post("/ready").status_code == 200
        running = session.forward_backward([{"tokens": [1, 2, 3]}])
        _run_next(group)

        cli = CliRunner(env={"MOETUNE_URL": service.url, "MOETUNE_TOKEN": TOKENS["tenant-a"]})
        assert cli.invoke(main, ["sessions", "restart", "--fresh", session.id], catch_exceptions=False).exit_code == 0
        with service.http() as http:
            info = http.get(f"/v1/training_sessions/{session.id}").json()
        assert (info["restarts"], info["restored_state"], info["restored_step"]) == (2, None, 0)
        group, run = _group(service, ray, session.id, 2)
        assert run.restore is None
        with pytest.raises(CallFailed) as lost:
            running.result(timeout=5)
        assert (lost.value.restarted, lost.value.restored_state, lost.value.restored_step) == (True, None, 0)
        assert "resumes from a fresh LoRA (asked for)" in str(lost.value)

        assert group.post("/ready").status_code == 200
        assert group.post("/ended", json={"reason": "failed"}).status_code == 200
        assert _group(service, ray, session.id, 3)[1].restore is None  # not s1: that was the LoRA before
        assert session.retrieve().restored_state is None
        group, _ = _group(service, ray, session.id, 3)
        assert group.post("/ready").status_code == 200
        session.save_state("s2")
        _run_next(group, {"uri": "s3://b/s2", "step": 1})
        assert group.post("/ended", json={"reason": "failed"}).status_code == 200
        assert _group(service, ray, session.id, 4)[1].restore == "s2"
        assert (session.retrieve().restored_state, session.info.restored_step) == ("s2", 1)
    finally:
        ray.close()


def test_the_leader_fails_an_overdue_start_that_nobody_reads(start_service):
    """No client looks at a session whose group never gets ready: the leader's scheduler pass fails it and stops its
    Ray job once session_start_timeout_s has passed (its workers are not held until someone reads it)."""
    ray = RayJobsAPI()
    service = start_service(ray_address=ray.url, session_start_timeout_s=1.0, scheduler_enabled=True,
                            scheduler_interval_s=0.1)
    try:
        stuck = Training(service.sdk()).create(SPEC)
        wait_for(lambda: records.get_session(service.store, stuck.id).status == "failed", 15,
                 "the leader to fail the overdue session", interval=0.1)
        row = records.get_session(service.store, stuck.id)
        assert row.error["code"] == "session_failed" and "session_start_timeout_s=1" in row.error["message"]
        assert ray.stopped == [f"moetune-{stuck.id}-0"]
    finally:
        ray.close()


def test_a_group_not_ready_within_the_start_timeout_fails_the_session_and_is_stopped(start_service):
    """A group that never reports ready (no free workers, a model that does not load): once
    session_start_timeout_s has passed since its submission, a look at the session fails it with the cause and
    stops its Ray job. A group that became ready is not timed, and a restarted group's clock starts at its own
    submission."""
    ray = RayJobsAPI()
    service = start_service(ray_address=ray.url, session_start_timeout_s=1.0)
    training = Training(service.sdk())
    try:
        stuck = training.create(SPEC)
        ready = training.create(SPEC)
        assert _group(service, ray, ready.id, 0)[0].post("/ready").status_code == 200
        with pytest.raises(RuntimeError) as failed:
            stuck.wait_ready(timeout=10, poll_interval=0.1)
        info = stuck.retrieve()
        assert (info.status, info.error.code) == ("failed", "session_failed")
        assert "not ready 1 s after it was submitted (session_start_timeout_s=1)" in info.error.message
        assert f"moetune-{stuck.id}-0 was stopped (it was RUNNING" in info.error.message
        assert "session_start_timeout_s=1" in str(failed.value)
        assert ray.stopped == [f"moetune-{stuck.id}-0"]

        an_hour_ago = time.time() - 3600
        records.set_session(service.store, ready.id, ("ready",), created_at=an_hour_ago)
        with service.store._write() as s:  # the ready group, submitted an hour ago
            s.execute(update(CallRow).where(CallRow.session_id == ready.id).values(created_at=an_hour_ago))
        assert ready.retrieve().status == "ready"  # ready: not timed
        assert ready.restart().status == "starting"
        assert ready.retrieve().status == "starting"  # timed from group 1's submission, not the session's creation
    finally:
        ray.close()
