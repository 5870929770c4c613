"""The chief's Reporter keeps the control plane's last answer (ReportAck): that is how a pause reaches the workers."""

from moetune.workers.reporting.reporter import Reporter


def test_reporter_keeps_the_last_ack(receiver, tmp_path):
    r = Reporter("ftjob-1", callback_url=receiver.url, token="t", backoff_s=0.01, directory=tmp_path)
    assert r.event("hi") and r.control is None
    receiver.control_for = lambda report: "pause" if report.report.kind == "event" else None
    assert r.metrics(2, train_loss=1.0) and r.control == "pause"
    assert r.checkpoint(2, "s3://b/out/checkpoints/step-2", train_loss=1.0) and r.control is None
    receiver.fail_first = 1  # a failed post keeps the previous answer until one is accepted
    r.control = "pause"
    assert not r.event("late") and r.control == "pause"
    receiver.control_for = lambda report: None
    assert r.flush(10) and r.control is None  # its answer once delivered
