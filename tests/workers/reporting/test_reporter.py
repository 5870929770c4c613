import pickle

from moetune.api.layout import result_from_summary
from moetune.service.local.embedded import free_port
from moetune.workers.reporting.reporter import Reporter


def test_posts_reports_with_the_job_token(receiver, tmp_path):
    r = Reporter("ftjob-1", callback_url=receiver.url, token="secret", directory=tmp_path)
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
    assert r.close() and not list(tmp_path.iterdir())  # all delivered: no outbox file left


def test_retries_server_errors(receiver, tmp_path):
    receiver.fail_first = 2
    r = Reporter("j", callback_url=receiver.url, token="t", backoff_s=0.01, directory=tmp_path)
    r.event("hi")  # not waited for once the control plane failed to answer: training goes on
    assert r.flush(10)
    assert len(receiver.requests) == 3 and len(receiver.reports) == 1


def test_never_raises_or_blocks_when_the_control_plane_is_down(tmp_path):
    port = free_port()  # nothing listens there once the probe socket is closed
    r = Reporter("j", callback_url=f"http://127.0.0.1:{port}", token="t", backoff_s=0.01, directory=tmp_path)
    assert r.event("hi") is False
    assert r.event("again") is False and r.outbox.pending() == 2
    assert not r.close(timeout_s=0)


def test_without_callback_url_only_logs():
    assert Reporter("j", callback_url=None, token=None).event("hi") is False


def test_a_pickled_reporter_reports_through_its_own_outbox(receiver, tmp_path):
    """Ray pickles the driver's reporter into the Train controller (its failure callback)."""
    copy = pickle.loads(pickle.dumps(Reporter("j", callback_url=receiver.url, token="t", directory=tmp_path)))
    assert copy.event("from the controller") and copy.close()
    assert [r.report.message for r in receiver.reports] == ["from the controller"]


def test_step_figures_read_as_numbers_not_python_reprs():
    from moetune.workers.reporting.reporter import _figure

    assert _figure({"1": 1.6405123, "12": 1.35}) == "[1: 1.641, 12: 1.35]"  # per layer, as the event log shows it
    assert (_figure(0.123456), _figure(7)) == ("0.1235", "7")
