from moetune.api.layout import result_from_summary
from moetune.service.local.embedded import free_port
from moetune.workers.reporting.reporter import Reporter


def test_posts_reports_with_the_job_token(receiver):
    r = Reporter("ftjob-1", callback_url=receiver.url, token="secret")
    assert r.event("Loading model")
    assert r.metrics(3, train_loss=1.5, total_steps=10)
    assert r.checkpoint(3, "s3://b/out/checkpoints/step-3", train_loss=1.5)
    assert r.send(result_from_summary("s3://b/out", {"trained_tokens": 42}))
    assert r.failed("invalid_training_file", "row 3: bad", "training_file")
    assert {req for req in receiver.requests} == {("/internal/v1/jobs/ftjob-1/reports", "Bearer secret")}
    kinds = [rep.report.kind for rep in receiver.reports]
    assert kinds == ["event", "event", "checkpoint", "result", "result"]
    assert receiver.metrics() == [{"step": 3, "train_loss": 1.5, "total_steps": 10}]
    assert receiver.of_kind("result")[1].error.param == "training_file"


def test_retries_server_errors(receiver):
    receiver.fail_first = 2
    assert Reporter("j", callback_url=receiver.url, token="t", backoff_s=0.01).event("hi")
    assert len(receiver.requests) == 3 and len(receiver.reports) == 1


def test_never_raises_when_the_control_plane_is_down():
    port = free_port()  # nothing listens there once the probe socket is closed
    r = Reporter("j", callback_url=f"http://127.0.0.1:{port}", token="t", attempts=2, backoff_s=0.01)
    assert r.event("hi") is False


def test_without_callback_url_only_logs():
    assert Reporter("j", callback_url=None, token=None).event("hi") is False
