"""Worker reports made while the control plane is away: the workers' outbox (workers/reporting/outbox.py) delivers
them once it is back, and the control plane stores each Idempotency-Key once, in order."""

from __future__ import annotations

from moetune.api.models.job_run import ResultReport
from moetune.service.app import create_app
from moetune.service.local.embedded import control_plane_in_thread, free_port
from moetune.workers.reporting.reporter import Reporter

from tests.support.control_plane import RunningService, settings_for


def _steps(service: RunningService, job_id: str) -> list[int]:
    events, _ = service.store.list_events(job_id, 1000)
    return [e.data["step"] for e in events if e.type == "metrics"]


def test_reports_made_while_the_control_plane_is_down_arrive_once_in_order(tmp_path, s3_endpoint, inputs):
    settings, port = settings_for(tmp_path, s3_endpoint_url=s3_endpoint), free_port()
    app = create_app(settings)
    with control_plane_in_thread(app, port) as url:
        service = RunningService(url, app)
        job_id = service.create_job(**inputs)["id"]
        reporter = Reporter(job_id, url, service.start_job(job_id), backoff_s=0.05, max_backoff_s=0.2,
                            directory=tmp_path / "outbox")
        for step in range(1, 6):
            assert reporter.metrics(step, train_loss=1.0 / step)
    # Stopped: its port refuses connections. Training goes on without waiting for the reports.
    for step in range(6, 16):
        assert reporter.metrics(step, train_loss=1.0 / step) is False
    app = create_app(settings)  # a new control plane on the same database and port
    with control_plane_in_thread(app, port) as url:
        service = RunningService(url, app)
        assert reporter.send(ResultReport(status="succeeded", fine_tuned_model="s3://b/adapter"))
        assert _steps(service, job_id) == list(range(1, 16))
        assert service.store.get_job(job_id).status == "succeeded"
    assert reporter.close(timeout_s=0)


def test_a_full_outbox_says_what_it_dropped(receiver, tmp_path):
    receiver.fail_first = 10**9  # the control plane answers 503 to every report
    reporter = Reporter("ftjob-1", receiver.url, "t", backoff_s=0.01, max_backoff_s=0.02, max_pending=3,
                        directory=tmp_path)
    reporter.event("Loading model")
    for step in range(1, 6):
        reporter.metrics(step, train_loss=1.0)
    assert reporter.outbox.pending() == 3
    receiver.fail_first = 0
    reporter.checkpoint(3, "s3://b/out/checkpoints/step-3", train_loss=1.0)
    assert reporter.close(timeout_s=10)
    messages = [r.report.message if r.report.kind == "event" else r.report.kind for r in receiver.reports]
    assert messages[:3] == ["Loading model", "Step 1: train_loss=1", "Step 2: train_loss=1"]
    assert messages[3].startswith("3 events were dropped while the control plane could not be reached, the metrics "
                                  "of steps 3-5 among them: the workers' outbox holds at most 3 unsent reports")
    assert receiver.of_kind("event")[3].data == {"dropped_events": 3, "dropped_steps": [3, 4, 5]}
    assert messages[4:] == ["checkpoint"]


def _post(service: RunningService, job_id: str, token: str, report: dict, key: str):
    return service.http(None).post(f"/internal/v1/jobs/{job_id}/reports", json={"report": report},
                                   headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key})


def test_a_redelivered_report_is_acknowledged_not_stored_twice(service, inputs):
    job_id = service.create_job(**inputs)["id"]
    token = service.start_job(job_id)
    step = {"kind": "event", "type": "metrics", "message": "Step 1", "data": {"step": 1, "train_loss": 2.0}}
    uri = service.checkpoint_uri(job_id, 1)
    assert service.report_checkpoint(job_id, token, 1).status_code == 200  # writes the manifest (no key)
    checkpoint = {"kind": "checkpoint", "step_number": 1, "uri": uri, "metrics": {"step": 1}}
    result = {"kind": "result", "status": "succeeded", "fine_tuned_model": "s3://b/adapter"}
    for report, key in ((step, "a:1"), (checkpoint, "a:2"), (step, "b:1"), (result, "a:3")):
        for _ in range(2):
            response = _post(service, job_id, token, report, key)
            assert response.status_code == 200, response.text
    assert _post(service, job_id, token, step, "a:1").status_code == 200  # an older one than the newest too
    assert _steps(service, job_id) == [1, 1]  # one per stream
    checkpoints, _ = service.store.list_checkpoints(job_id, 10)
    assert len(checkpoints) == 2  # the keyless one and a:2
    events, _ = service.store.list_events(job_id, 100)
    assert sum(e.message == "Job succeeded" for e in events) == 1
    assert _post(service, job_id, token, step, "a:4").status_code == 409  # a new report after the end: refused
    bad = _post(service, job_id, token, step, "no-sequence")
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "Idempotency-Key"
