"""Reading the Serve app's state from a Ray dashboard that drops a connection without answering (what a busy one
did under `moetune demo` on a loaded machine): a real TCP server on loopback stands in for the dashboard, because
a real dashboard drops connections only under load nobody can cause on purpose."""

from __future__ import annotations

import json
import socketserver
import threading

import click
import pytest

from moetune.service.api_exception import APIException
from moetune.service.cluster import serve_deploy

APPS = json.dumps({"applications": {serve_deploy.APP_NAME: {
    "status": "RUNNING", "deployed_app_config": {"args": {"bases": {"tiny": "s3://b/m"}}}}}}).encode()


class _DropsFirst(socketserver.BaseRequestHandler):
    drops = 0
    seen = 0
    body = APPS

    def handle(self):
        type(self).seen += 1
        data = b""
        while b"\r\n\r\n" not in data and (chunk := self.request.recv(4096)):
            data += chunk
        if type(self).seen <= type(self).drops:
            return  # closed without an answer
        self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: " + str(len(self.body)).encode() + b"\r\n\r\n" + self.body)


@pytest.fixture
def dashboard():
    _DropsFirst.body = APPS
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _DropsFirst) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{srv.server_address[1]}"
        srv.shutdown()


@pytest.mark.parametrize("drops", [1, 2])
def test_a_dropped_read_is_sent_again(dashboard, drops):
    _DropsFirst.drops, _DropsFirst.seen = drops, 0
    assert serve_deploy.current_app(dashboard) == {"args": {"bases": {"tiny": "s3://b/m"}}, "status": "RUNNING",
                                                  "message": ""}
    assert _DropsFirst.seen == drops + 1


def test_a_dashboard_that_keeps_dropping_is_unavailable(dashboard):
    _DropsFirst.drops, _DropsFirst.seen = 99, 0
    with pytest.raises(APIException) as failed:
        serve_deploy.current_app(dashboard)
    assert failed.value.status_code == 503 and "did not answer" in str(failed.value.message)
    assert _DropsFirst.seen == 3


# Ray 2.60's answer to GET /api/serve/applications/ for an app whose replica constructor raised (recorded from a real
# head, a deployment raising BaseTooLargeError in __init__; the traceback's middle frames shortened)
FAILED_APP = {"applications": {serve_deploy.APP_NAME: {
    "name": serve_deploy.APP_NAME, "route_prefix": "/", "status": "DEPLOY_FAILED",
    "message": "Failed to update the deployments ['engine-tiny'].", "deployed_app_config": {"args": {}},
    "deployments": {"engine-tiny": {
        "name": "engine-tiny", "status": "DEPLOY_FAILED", "status_trigger": "REPLICA_STARTUP_FAILED",
        "message": "The deployment failed to start 3 times in a row. This may be due to a problem with its "
                   "constructor or initial health check failing. See controller logs for details. Error:\n"
                   "\x1b[36mray::ServeReplica:moetune-serve:engine-tiny.initialize_and_get_metadata()\x1b[39m "
                   "(pid=28333, ip=192.0.2.2)\n  File \"ray/serve/_private/replica.py\", line 1928, in initialize\n"
                   "    raise RuntimeError(traceback.format_exc()) from None\nRuntimeError: Traceback (most recent "
                   "call last):\n  File \"rec.py\", line 12, in __init__\n    raise BaseTooLargeError(\"the base's "
                   "weights take 140.0 GiB, more than one device holds (80.0 GiB)\")\nBaseTooLargeError: the base's "
                   "weights take 140.0 GiB, more than one device holds (80.0 GiB)"}}}}}
CAUSE = ("engine-tiny: The deployment failed to start 3 times in a row. This may be due to a problem with its "
         "constructor or initial health check failing. See controller logs for details. Error: BaseTooLargeError: "
         "the base's weights take 140.0 GiB, more than one device holds (80.0 GiB)")


def test_a_failed_deployment_carries_rays_cause():
    app = FAILED_APP["applications"][serve_deploy.APP_NAME]
    assert serve_deploy.failure_message(app) == CAUSE
    # a running app's healthy deployments have nothing to say
    assert serve_deploy.failure_message({"status": "RUNNING", "message": "", "deployments": {
        "engine-tiny": {"status": "HEALTHY", "message": ""}}}) == ""


def test_deploying_what_already_failed_answers_the_cause(dashboard):
    """The deploy routes' answer (a 503 naming Ray's cause) and the CLI's wait (`jobs deploy`, `serve`)."""
    from moetune.service.cli.serve import _require_running

    args = {"control_plane_url": "http://cp", "bases": {"huge": "s3://b/huge"}, "s3_endpoint_url": None}
    failed = json.loads(json.dumps(FAILED_APP))
    failed["applications"][serve_deploy.APP_NAME]["deployed_app_config"]["args"] = args
    _DropsFirst.drops, _DropsFirst.seen, _DropsFirst.body = 0, 0, json.dumps(failed).encode()
    with pytest.raises(APIException) as refused:
        serve_deploy.deploy(dashboard, "http://127.0.0.1:8001", "http://cp", {"huge": "s3://b/huge"})
    assert refused.value.status_code == 503 and refused.value.message == f"The Serve app is DEPLOY_FAILED: {CAUSE}"
    with pytest.raises(click.ClickException) as exited:
        _require_running(dashboard, 0)
    assert exited.value.message == f"the Serve app is DEPLOY_FAILED: {CAUSE}"


def test_a_serve_listening_on_another_port_is_refused_before_any_deploy(dashboard):
    """Serve ignores a later config's HTTP port: deploying for another serve_url would leave its clients
    connecting to nothing, so the deploy says where Serve listens instead of sending the config."""
    _DropsFirst.drops, _DropsFirst.seen = 0, 0
    _DropsFirst.body = json.dumps({"controller_info": {"node_id": "n"}, "http_options": {"port": 8123},
                                   "applications": {}}).encode()
    with pytest.raises(APIException) as refused:
        serve_deploy.deploy(dashboard, "http://127.0.0.1:8124", "http://cp", {"tiny": "s3://b/m"})
    assert refused.value.status_code == 503 and "listens on port 8123" in refused.value.message
    assert _DropsFirst.seen == 1  # one read, no PUT
