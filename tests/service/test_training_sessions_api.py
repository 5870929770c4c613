"""The training-session routes' refusals, without a worker group: a control plane whose Ray is down (the
end-to-end session is tests/e2e/test_training_sessions.py); the CLI's view of them."""

from __future__ import annotations

import re

from click.testing import CliRunner

from moetune.service.cli.main import main
from moetune.service.local.embedded import free_port
from tests.support.control_plane import TOKENS
from tests.support.ray_jobs_api import RayJobsAPI
from tests.support.waiting import wait_for


def test_refusals_name_the_field_and_a_session_ray_never_took_is_failed(start_service):
    service = start_service(ray_address=f"http://127.0.0.1:{free_port()}")
    with service.http() as http:
        unknown = http.post("/v1/training_sessions", json={"model": "no-such-base"})
        assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "model"
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
