"""Webhooks: a real HTTP receiver on loopback (bench.support.webhook_receiver) checks every delivery with the official
`openai` SDK's verification (client.webhooks.unwrap with the endpoint's secret) and fails the first tries of each
event; the outbox survives a control-plane restart between enqueue and delivery."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner
from pydantic import ValidationError
from sqlalchemy import select, update

from bench.support.webhook_receiver import Receiver, Route, receiving
from moetune.api.client import APIError
from moetune.service.cli import main as cli
from moetune.service.settings import Settings
from moetune.service.webhooks.delivery import retry_delay
from moetune.service.store.webhooks import DeliveryRow
from tests.support.control_plane import run_service, settings_for

FAST_RETRIES = {"webhook_retry_base_s": 0.02, "webhook_retry_max_s": 0.1, "webhook_poll_interval_s": 0.02}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as receiver:
        yield receiver


def _until(done: Callable[[], bool], timeout: float = 30) -> None:
    """The delivery loop writes its outcome just after the receiver answers: wait for that write."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _deliveries(service, endpoint_id: str) -> list[DeliveryRow]:
    with service.store._sessions() as s:
        return list(s.scalars(select(DeliveryRow).where(DeliveryRow.endpoint_id == endpoint_id)))


def _endpoint(service, receiver: Receiver, path: str, tenant: str = "tenant-a", fail_first: int = 0, **fields):
    endpoint = service.sdk(tenant).webhooks.create(receiver.url + path, **fields)
    receiver.routes[path] = Route(fail_first=fail_first, secret=endpoint.signing_secret)
    return endpoint


def test_each_event_is_verified_by_the_openai_sdk_and_accepted_once_after_three_refusals(tmp_path, s3_endpoint,
                                                                                          output_bucket, receiver):
    with run_service(settings_for(tmp_path, s3_endpoint_url=s3_endpoint, **FAST_RETRIES)) as service:
        every = _endpoint(service, receiver, "/every", fail_first=3)
        assert every.signing_secret.startswith("whsec_") and every.event_types == [
            "fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled",
            "fine_tuning.job.paused", "fine_tuning.job.checkpoint.created"]
        _endpoint(service, receiver, "/succeeded", event_types=["fine_tuning.job.succeeded"])
        other = _endpoint(service, receiver, "/tenant-b", tenant="tenant-b")

        sdk = service.sdk()
        succeeded, paused, failed = (service.create_job()["id"] for _ in range(3))
        token = service.start_job(succeeded)
        assert service.report_checkpoint(succeeded, token, 1, train_loss=1.0).status_code == 200
        service.report(succeeded, token, {"kind": "result", "status": "succeeded", "fine_tuned_model": "s3://o/a"})
        token = service.start_job(paused)
        sdk.jobs.pause(paused)  # pausing is no event; paused is
        service.report(paused, token, {"kind": "result", "status": "paused"})
        sdk.jobs.cancel(paused)
        service.report(failed, service.start_job(failed), {"kind": "result", "status": "failed"})

        expected = [(succeeded, "checkpoint.created"), (succeeded, "succeeded"), (paused, "paused"),
                    (paused, "cancelled"), (failed, "failed")]
        route = receiver.routes["/every"]
        receiver.wait(lambda: len(route.accepted) == len(expected) and receiver.routes["/succeeded"].accepted)
        _until(lambda: all(d.status == "delivered" for d in _deliveries(service, every.id)))

        events = {(e["data"]["id"], e["type"].removeprefix("fine_tuning.job.")): e
                  for (e,) in route.accepted.values()}  # exactly one accepted delivery per event id
        assert sorted(events) == sorted(expected) and all(e["object"] == "event" for e in events.values())
        assert events[succeeded, "checkpoint.created"]["data"] == {"id": succeeded, "step_number": 1}
        assert route.tries == {e["id"]: 4 for e in events.values()} and route.forged == 0
        assert [d.attempts for d in _deliveries(service, every.id)] == [4] * 5  # nothing left to send again
        (only,) = receiver.routes["/succeeded"].accepted.values()
        assert only[0] == events[succeeded, "succeeded"]  # one event, one id, whichever endpoint it goes to
        assert _deliveries(service, other.id) == []  # tenant-b's endpoint hears nothing of tenant-a's jobs

        # A delivery still refused when its retry window (72 h) has passed is given up, visibly on the job.
        receiver.routes["/tenant-b"].fail_first = 10**6
        lost = service.create_job("tenant-b")["id"]
        service.sdk("tenant-b").jobs.cancel(lost)
        receiver.wait(lambda: receiver.routes["/tenant-b"].tries)
        with service.store._write() as s:
            s.execute(update(DeliveryRow).where(DeliveryRow.endpoint_id == other.id)
                      .values(created_at=time.time() - 72 * 3600))
        _until(lambda: _deliveries(service, other.id)[0].status == "gave_up")
        (gave_up,) = [e for e in service.sdk("tenant-b").jobs.events_since(lost) if "Webhook" in e.message]
        assert gave_up.level == "warn" and gave_up.message.endswith(": HTTP 503")
        assert "fine_tuning.job.cancelled" in gave_up.message


def test_endpoints_api_cli_and_settings_refusals(service, receiver):
    a, b = service.sdk("tenant-a"), service.sdk("tenant-b")
    with pytest.raises(APIError) as bad_url:
        a.webhooks.create("ftp://example.com/hook")
    with pytest.raises(APIError) as bad_event:
        a.webhooks.create(receiver.url, event_types=["fine_tuning.job.running"])
    assert (bad_url.value.status_code, bad_url.value.param) == (422, "url")
    assert (bad_event.value.status_code, bad_event.value.param) == (422, "event_types.0")

    result = CliRunner().invoke(cli.main, ["--url", service.url, "--token", "tok-a", "webhooks", "create",
                                           receiver.url + "/cli", "--event", "fine_tuning.job.failed"])
    assert result.exit_code == 0, result.output
    endpoint_id = result.output.split()[1]
    secret = result.output.strip().splitlines()[-1].split()[-1]
    endpoint = a.webhooks.retrieve(endpoint_id)
    assert endpoint.event_types == ["fine_tuning.job.failed"] and endpoint.name == "127.0.0.1"
    assert secret.startswith("whsec_") and secret not in endpoint.model_dump_json()  # shown once only
    assert endpoint.signing_secret_hint == f"{secret[:9]}...{secret[-4:]}"
    assert endpoint_id in [e.id for e in a.webhooks.list().data]
    assert endpoint_id not in [e.id for e in b.webhooks.list().data]
    with pytest.raises(APIError) as foreign:
        b.webhooks.retrieve(endpoint_id)
    assert foreign.value.status_code == 404
    assert a.webhooks.delete(endpoint_id).deleted
    assert endpoint_id not in [e.id for e in a.webhooks.list().data]

    with pytest.raises(ValidationError, match="at least 86400"):
        Settings(webhook_retry_for_s=3600)
    fast = Settings(**FAST_RETRIES)
    for attempts, cap in ((1, 0.02), (2, 0.04), (3, 0.08), (4, 0.1), (40, 0.1)):
        assert cap / 2 <= retry_delay(attempts, fast) <= cap


def test_an_event_enqueued_before_a_restart_is_delivered_after_it(tmp_path, s3_endpoint, output_bucket, receiver):
    settings = settings_for(tmp_path, s3_endpoint_url=s3_endpoint, **FAST_RETRIES)
    with run_service(settings) as first:
        endpoint = _endpoint(first, receiver, "/restart", fail_first=10**6)
        job_id = first.create_job()["id"]
        first.sdk().jobs.cancel(job_id)
        route = receiver.routes["/restart"]
        receiver.wait(lambda: sum(route.tries.values()) >= 2)  # refused, then this control plane stops
    (stopped,) = _deliveries(first, endpoint.id)
    assert stopped.status == "pending" and stopped.attempts == sum(route.tries.values())  # every try recorded
    route.fail_first = 0
    with run_service(settings) as second:
        receiver.wait(lambda: route.accepted)
        _until(lambda: _deliveries(second, endpoint.id)[0].status == "delivered")
        (delivery,) = _deliveries(second, endpoint.id)
    (events,) = route.accepted.values()
    assert [(e["type"], e["data"]["id"]) for e in events] == [("fine_tuning.job.cancelled", job_id)]
    assert delivery.attempts == stopped.attempts + 1 and delivery.event_id == events[0]["id"]
