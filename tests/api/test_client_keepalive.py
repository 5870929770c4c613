"""The SDK against a server that closes a kept-alive connection without answering the next request on it (what
uvicorn's idle timeout does when it ends just as the client reuses the connection: httpx's "Server disconnected
without sending a response"). A real TCP server on loopback causes it on every reused connection."""

from __future__ import annotations

import json
import socketserver
import threading

import httpx
import pytest

from moetune.api.client import Client

MODEL = json.dumps({"id": "m", "created": 0, "owned_by": "moetune"}).encode()


def _read_request(conn) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return data
        data += chunk
    return data


class _AnswersOncePerConnection(socketserver.BaseRequestHandler):
    requests: list[bytes] = []

    def handle(self):
        self.requests.append(_read_request(self.request))
        self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(MODEL)).encode() + b"\r\n\r\n" + MODEL)
        if second := _read_request(self.request):  # the client reuses the connection: no answer, just close
            self.requests.append(second)


@pytest.fixture
def server():
    _AnswersOncePerConnection.requests = []
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _AnswersOncePerConnection) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{srv.server_address[1]}"
        srv.shutdown()


def test_an_idempotent_request_is_sent_again_on_a_fresh_connection(server):
    with Client(server, token="t") as client:
        assert client.models.retrieve("m").id == "m"
        assert client.models.retrieve("m").id == "m"  # its first try went out on the closed connection
    assert len(_AnswersOncePerConnection.requests) == 3
    assert all(r.startswith(b"GET /v1/models/m ") for r in _AnswersOncePerConnection.requests)


def test_a_post_is_not_sent_twice(server):
    with Client(server, token="t") as client:
        client.models.retrieve("m")
        with pytest.raises(httpx.RemoteProtocolError):
            client.jobs.cancel("ftjob-1")
    assert [r.split(b" ")[:2] for r in _AnswersOncePerConnection.requests] == [
        [b"GET", b"/v1/models/m"], [b"POST", b"/v1/fine_tuning/jobs/ftjob-1/cancel"]]
