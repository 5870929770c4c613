"""The chief's Reporter keeps the control plane's last answer (ReportAck): that is how a pause reaches the workers."""

from moetune.workers.reporting.reporter import Reporter


def test_reporter_keeps_the_last_ack(receiver):
    r = Reporter("ftjob-1", callback_url=receiver.url, token="t")
    assert r.event("hi") and r.control is None
    receiver.control_for = lambda report: "pause" if report.report.kind == "event" else None
    assert r.metrics(2, train_loss=1.0) and r.control == "pause"
    assert r.checkpoint(2, "s3://b/out/checkpoints/step-2", train_loss=1.0) and r.control is None
    receiver.fail_first = 1  # a rejected post keeps the previous answer until one is accepted
    r.attempts = 1
    r.control = "pause"
    assert not r.event("lost") and r.control == "pause"
