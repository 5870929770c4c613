"""The live event stream (Server-Sent Events) over real HTTP."""

import json
import threading

import httpx

from moetune.api.models.responses import JobEvent
from moetune.service.routes import event_stream

JOBS = "/v1/fine_tuning/jobs"


def read_stream(service, job_id: str, lines: list[str], **kwargs) -> None:
    with service.http().stream("GET", f"{JOBS}/{job_id}/events", timeout=httpx.Timeout(10, read=20),
                               **kwargs) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines.extend(response.iter_lines())


def frames(lines: list[str]) -> list[dict[str, str]]:
    """Events as {field: value}; comment lines are kept under ':'."""
    out, current = [], {}
    for line in lines:
        if not line:
            if current:
                out.append(current)
            current = {}
        else:
            field, _, value = line.partition(":")
            current[field or ":"] = value.strip()
    return out


def test_reported_events_arrive_live_and_the_stream_ends_with_the_job(service):
    job_id = service.create_job()["id"]
    token = service.start_job(job_id)
    lines: list[str] = []
    reader = threading.Thread(target=read_stream, args=(service, job_id, lines), kwargs={"params": {"stream": "true"}})
    reader.start()

    for step in (1, 2, 3):
        service.report(job_id, token, {"kind": "event", "type": "metrics", "message": f"Step {step}",
                                       "data": {"step": step, "total_steps": 3, "train_loss": 3.0 / step}})
    service.report(job_id, token, {"kind": "result", "status": "succeeded", "fine_tuned_model": "s3://o/a"})
    reader.join(15)
    assert not reader.is_alive(), "the stream did not end after the job finished"

    *events, done = frames(lines)
    parsed = [JobEvent.model_validate_json(e["data"]) for e in events]
    assert [e.message for e in parsed] == ["Job created", "Validating files", "Job queued", "Job started",
                                           "Step 1", "Step 2", "Step 3", "Job succeeded"]
    assert [e["id"] for e in events] == [e.id for e in parsed]
    assert parsed[5].type == "metrics" and parsed[5].data["step"] == 2
    assert done["event"] == "done" and json.loads(done["data"]) == {"status": "succeeded"}


def test_last_event_id_resumes_after_that_event(service):
    job_id = service.create_job()["id"]
    service.http().post(f"{JOBS}/{job_id}/cancel")
    first_two = service.http().get(f"{JOBS}/{job_id}/events", params={"limit": 2}).json()

    lines: list[str] = []
    read_stream(service, job_id, lines, headers={"Accept": "text/event-stream", "Last-Event-ID": first_two["last_id"]})
    *events, done = frames(lines)
    assert [JobEvent.model_validate_json(e["data"]).message for e in events] == ["Job cancelled"]
    assert done["event"] == "done"

    bad = service.http().get(f"{JOBS}/{job_id}/events", headers={"Accept": "text/event-stream",
                                                                 "Last-Event-ID": "garbage"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "Last-Event-ID"


def test_an_idle_stream_sends_keep_alive_comments(service, monkeypatch):
    monkeypatch.setattr(event_stream, "KEEPALIVE_INTERVAL_S", 0.2)
    job_id = service.create_job()["id"]
    token = service.start_job(job_id)
    lines: list[str] = []
    reader = threading.Thread(target=read_stream, args=(service, job_id, lines), kwargs={"params": {"stream": "true"}})
    reader.start()
    threading.Event().wait(1.0)
    service.report(job_id, token, {"kind": "result", "status": "failed",
                                   "error": {"code": "oom", "message": "out of memory"}})
    reader.join(15)
    assert any(f.get(":") == "keep-alive" for f in frames(lines))
    assert frames(lines)[-1]["event"] == "done"
