"""Reading the Serve app's state from a Ray dashboard that drops a connection without answering (what a busy one
did under `moetune demo` on a loaded machine): a real TCP server on loopback stands in for the dashboard, because
a real dashboard drops connections only under load nobody can cause on purpose."""

from __future__ import annotations

import json
import socketserver
import threading

import pytest

from moetune.service.api_exception import APIException
from moetune.service.cluster import serve_deploy

APPS = json.dumps({"applications": {serve_deploy.APP_NAME: {
    "status": "RUNNING", "deployed_app_config": {"args": {"bases": {"tiny": "s3://b/m"}}}}}}).encode()


class _DropsFirst(socketserver.BaseRequestHandler):
    drops = 0
    seen = 0

    def handle(self):
        type(self).seen += 1
        data = b""
        while b"\r\n\r\n" not in data and (chunk := self.request.recv(4096)):
            data += chunk
        if type(self).seen <= type(self).drops:
            return  # closed without an answer
        self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: " + str(len(APPS)).encode() + b"\r\n\r\n" + APPS)


@pytest.fixture
def dashboard():
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _DropsFirst) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{srv.server_address[1]}"
        srv.shutdown()


@pytest.mark.parametrize("drops", [1, 2])
def test_a_dropped_read_is_sent_again(dashboard, drops):
    _DropsFirst.drops, _DropsFirst.seen = drops, 0
    assert serve_deploy.current_app(dashboard) == {"args": {"bases": {"tiny": "s3://b/m"}}, "status": "RUNNING"}
    assert _DropsFirst.seen == drops + 1


def test_a_dashboard_that_keeps_dropping_is_unavailable(dashboard):
    _DropsFirst.drops, _DropsFirst.seen = 99, 0
    with pytest.raises(APIException) as failed:
        serve_deploy.current_app(dashboard)
    assert failed.value.status_code == 503 and "did not answer" in str(failed.value.message)
    assert _DropsFirst.seen == 3
