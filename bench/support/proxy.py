"""A small HTTP proxy in front of the real S3 server: counts the body bytes it relays and the ranged GETs signed in
their URL (presigned), injects faults into ranged GETs (HTTP 500 or 403, cut connection, truncated body, flipped
byte), can serve HTTPS, and can make storage unreachable: from the first write to a chosen key prefix on, every
request's connection is cut until restore()."""

from __future__ import annotations

import http.client
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


class FaultProxy:
    def __init__(self, upstream: str, tls: ssl.SSLContext | None = None):
        self.upstream, target = upstream, urlparse(upstream)
        self.bytes_relayed = 0
        self.ranged_gets = 0
        self.presigned_gets = 0  # ranged GETs signed in their query string
        self.requests = 0  # of any kind
        self.fault: str | None = None  # "500" | "403" | "cut" | "truncate" | "flip"
        self.fault_count = 0  # how many ranged GETs still get the fault (-1: all)
        self.faults_from_byte = 0  # only ranged GETs starting at this byte or later get faults (weights, not headers)
        self.outage_after: str | None = None  # a PUT or POST whose path holds this starts an outage
        self.outage = threading.Event()  # set while every request is cut
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self):
                with proxy.lock:
                    proxy.requests += 1
                if proxy._unreachable(self.command, self.path):
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                ranged = self.command == "GET" and "Range" in self.headers
                fault = proxy._take_fault(int(self.headers["Range"].split("=")[1].split("-")[0]),
                                          "X-Amz-Signature=" in self.path) if ranged else None
                if fault in ("500", "403"):
                    code = b"InternalError" if fault == "500" else b"AccessDenied"
                    self._send(int(fault), {"Content-Type": "application/xml"}, b"<Error><Code>%s</Code></Error>" % code)
                    return
                if fault == "cut":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                headers_out = {k: v for k, v in response.getheaders()
                               if k.lower() not in ("transfer-encoding", "connection", "content-length")}
                if self.command == "HEAD":  # no body: keep the object's own length
                    data = b"\0" * int(response.getheader("Content-Length") or 0)
                if fault == "flip" and data:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                if fault == "truncate":
                    headers_out["Content-Length"] = str(len(data))
                    self.send_response(response.status)
                    for k, v in headers_out.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                    self.connection.shutdown(1)
                    return
                with proxy.lock:
                    proxy.bytes_relayed += len(data) if self.command == "GET" else 0
                self._send(response.status, headers_out, data)

            def _send(self, status, headers, data):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:  # HTTPS to its clients (the upstream stays plain HTTP)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _take_fault(self, start: int, presigned: bool) -> str | None:
        with self.lock:
            self.ranged_gets += 1
            self.presigned_gets += presigned
            if self.fault is None or self.fault_count == 0 or start < self.faults_from_byte:
                return None
            if self.fault_count > 0:
                self.fault_count -= 1
            return self.fault

    def _unreachable(self, command: str, path: str) -> bool:
        with self.lock:
            if self.outage_after and command in ("PUT", "POST") and self.outage_after in path:
                self.outage_after = None
                self.outage.set()
            return self.outage.is_set()

    def cut_from_write(self, path_part: str) -> None:
        """Storage becomes unreachable at the first write whose path holds `path_part`, and stays so."""
        with self.lock:
            self.outage_after = path_part

    def restore(self) -> None:
        with self.lock:
            self.outage_after = None
            self.outage.clear()

    def inject(self, fault: str | None, count: int = -1) -> None:
        with self.lock:
            self.fault, self.fault_count = fault, count

    def reset_counts(self) -> None:
        with self.lock:
            self.bytes_relayed = self.ranged_gets = self.presigned_gets = self.requests = 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
