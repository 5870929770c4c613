"""Ranged GETs of S3 objects on plain HTTP(S) connections, each response body read by the socket straight into
its destination memory.

Through fsspec, every received piece of every body becomes a Python bytes object on the one event-loop thread of
the process before it is copied out: 0.60-0.64 CPU-s per GiB of that thread on a 2-core VM, a ceiling of about
1.5 GB/s per process whatever the NIC. Here each fetch thread sends a presigned GET (signed by botocore with the
filesystem's options: same credentials, endpoint, addressing) on a kept-alive connection and `readinto` fills the
parameters' memory with `recv_into`, the GIL released: the loop thread's share drops to 0.05 (presigning), the
loader's client CPU from 1.22-1.32 to 0.98-1.03 s per GiB (bench/streaming.py's checkpoint, both in one process).

Used only where it talks to the same server the same way as the filesystem would: no proxy configured for the
endpoint (environment or `config_kwargs`), no extra request parameters (`s3_additional_kwargs`, requester pays),
certificates checked as botocore would (`verify`, AWS_CA_BUNDLE). Any other 4xx than 404 (a redirect to a
bucket's region, which botocore follows and a presigned URL does not; a server that takes no presigned URLs; a
denial, which botocore's own request then reports) raises `DirectRefused`, and the fetcher goes back to fsspec
for the rest of the load.
"""

from __future__ import annotations

import functools
import http.client
import re
import ssl
import threading
import urllib.parse
import urllib.request
from collections import defaultdict

from moetune.workers.weights.s3 import is_s3

_PRESIGN_SECONDS = 3600  # each request is signed just before it is sent; this only has to outlast the response
_ERROR_BYTES = 64 * 1024  # read of an error response's body, for its code and message


class DirectRefused(Exception):
    """Only botocore's own client can make this request: storage redirected or refused the presigned GET, or
    the environment sends it through a proxy."""


def _error_code(body: bytes) -> str:
    """The S3 error code and message of an XML error body, or its first bytes."""
    text = body.decode("utf-8", "replace")
    code, message = re.search(r"<Code>(.*?)</Code>", text), re.search(r"<Message>(.*?)</Message>", text)
    return " ".join(m.group(1) for m in (code, message) if m) or text[:200]


class DirectBody:
    """The open body of one ranged GET; `read_into` as the fsspec path's body (workers.weights.s3)."""

    def __init__(self, owner: DirectRanges, key: tuple, connection, response):
        self.owner, self.key, self.connection, self.response = owner, key, connection, response

    def read_into(self, views: list[memoryview]) -> int:
        """Fills `views` in order; returns the bytes read (fewer where the response ended early)."""
        total = 0
        for view in views:
            filled = self.response.readinto(view)  # a buffered read: whole unless the response ends first
            total += filled
            if filled < len(view):
                break
        return total

    def close(self) -> None:
        if self.response.isclosed():  # read to its end: the connection serves a next request
            self.owner.keep(self.key, self.connection)
        else:
            self.connection.close()


class DirectRanges:
    """Presigned ranged GETs of one S3 filesystem on kept-alive connections (at most one per fetch thread);
    `close` ends those left idle."""

    def __init__(self, fs):
        from fsspec.asyn import sync

        self.fs, self.sync = fs, sync
        sync(fs.loop, fs.set_session)  # its botocore session, whose loaded service models the twin reuses (~5 ms)
        self.ca_bundle = fs.session.get_config_variable("ca_bundle")  # AWS_CA_BUNDLE or the config file's, as botocore
        # a twin of the filesystem told to sign with SigV4: left to choose, botocore presigns S3 URLs with SigV2,
        # which AWS regions opened since 2014 and buckets created since 2020 refuse
        twin = type(fs)(**{**fs.storage_options, "config_kwargs": {**fs.config_kwargs, "signature_version": "s3v4"}},
                        session=fs.session)
        self.client = sync(fs.loop, twin.set_session)
        config = fs.config_kwargs
        self.timeout = max(config.get("connect_timeout", 60), config.get("read_timeout", 60))
        self.idle: dict[tuple, list] = defaultdict(list)  # (scheme, host, port) -> connections
        self.lock = threading.Lock()

    @functools.cached_property
    def tls(self) -> ssl.SSLContext:
        """Certificates checked as the filesystem's client checks them; built at the first HTTPS connection
        (loading the CA store takes ~25 ms)."""
        verify = self.fs.client_kwargs.get("verify")
        if verify is False:
            return ssl._create_unverified_context()  # noqa: S323 - what the filesystem was told to do
        return ssl.create_default_context(cafile=verify if isinstance(verify, str) else self.ca_bundle)

    def _url(self, path: str) -> str:
        bucket, key, version = self.fs.split_path(path)
        params = {"Bucket": bucket, "Key": key, **({"VersionId": version} if version else {})}
        return self.sync(self.fs.loop, self.client.generate_presigned_url, "get_object", Params=params,
                         ExpiresIn=_PRESIGN_SECONDS)

    def _connection(self, key: tuple) -> tuple[object, bool]:
        """(an idle kept-alive connection to the server, True) or (a new one, False)."""
        with self.lock:
            if self.idle[key]:
                return self.idle[key].pop(), True
        scheme, host, port = key
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self.tls), False
        return http.client.HTTPConnection(host, port, timeout=self.timeout), False

    def keep(self, key: tuple, connection) -> None:
        with self.lock:
            self.idle[key].append(connection)

    def close(self) -> None:
        with self.lock:
            idle = [c for connections in self.idle.values() for c in connections]
            self.idle.clear()
        for connection in idle:
            connection.close()

    def open(self, path: str, start: int, end: int) -> DirectBody:
        """The body of a GET of bytes [start, end) of `path`; FileNotFoundError, DirectRefused or another error
        (retried by the caller) when storage does not send them."""
        url = urllib.parse.urlsplit(self._url(path))
        if url.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(url.hostname):
            raise DirectRefused(f"{url.netloc} is reached through a proxy (environment)")
        key = (url.scheme, url.hostname, url.port)
        target = f"{url.path}?{url.query}"
        while True:
            connection, reused = self._connection(key)
            try:
                connection.request("GET", target, headers={"Range": f"bytes={start}-{end - 1}"})
                response = connection.getresponse()
                break
            except (ConnectionError, http.client.HTTPException):
                connection.close()
                if not reused:
                    raise
                # the server closed a kept-alive connection while it was idle: once more on a new one
        if response.status == 206:
            length = response.getheader("Content-Length")
            if length is not None and int(length) != end - start:
                connection.close()
                raise OSError(f"asked for {end - start} bytes, the response holds {length}")
            return DirectBody(self, key, connection, response)
        # an error's body is a short XML document; a 200 would be the whole object (storage ignoring the Range)
        detail = f"HTTP {response.status} {_error_code(response.read(_ERROR_BYTES) if response.status != 200 else b'')}"
        connection.close()
        if response.status == 404:
            raise FileNotFoundError(f"{path}: {detail}")
        if response.status < 500 and response.status not in (408, 429):
            # a 403 too: botocore's client tells a denial apart from a signature the server does not take
            raise DirectRefused(f"{path}: {detail}")
        raise OSError(detail)  # throttling, server errors: retried


def direct_ranges(fs) -> DirectRanges | None:
    """Direct ranged GETs for `fs`, or None where its requests need botocore's own client: not S3, unsigned
    requests, extra request parameters, a proxy in its configuration."""
    if not is_s3(fs) or fs.anon or fs.s3_additional_kwargs or fs.requester_pays:
        return None
    if fs.config_kwargs.get("proxies"):
        return None
    return DirectRanges(fs)
