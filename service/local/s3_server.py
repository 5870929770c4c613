"""The local S3-compatible server: moto's S3 app, optionally durable.

`python -m moetune.service.local.s3_server --port P [--data-dir D]`. Without a data directory it keeps objects in
memory (the test suite's server: fast, thrown away). With one (`moetune up`), every write is mirrored into D before
the server answers it, and D is loaded back at start: an acknowledged PutObject, CompleteMultipartUpload,
CopyObject, DeleteObject(s), CreateBucket or DeleteBucket survives a crash (SIGKILL) of this server. Each object is
one file (a JSON header line, then the bytes) written to a temporary name and renamed, so a crash mid-write leaves
the previous version. No fsync: this protects against the server dying, not the machine.

The mirror reads the object back through the S3 protocol from the in-process app, so it depends on no moto
internals. Parts of an unfinished multipart upload are not mirrored: after a crash the upload's completion fails
(NoSuchUpload) and the writer retries; no acknowledged object is lost.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import parse_qs, quote

from werkzeug.test import EnvironBuilder
from werkzeug.wsgi import get_input_stream

# moto accepts any SigV4-shaped credentials; unsigned requests are anonymous and see only public objects
_AUTH = {"Authorization": "AWS4-HMAC-SHA256 Credential=moetune-local/20250101/us-east-1/s3/aws4_request, "
                          "SignedHeaders=host, Signature=0"}
# what a restored object keeps besides its bytes
_KEPT_HEADERS = ("content-type", "content-encoding", "content-disposition", "content-language", "cache-control")
_SUFFIX = ".obj"


def s3_app():
    from moto.moto_server.werkzeug_app import create_backend_app

    return create_backend_app("s3")


class DurableS3:
    """WSGI layer over the S3 app: mutating requests are applied and mirrored into `root` under one lock (so the
    files follow the order the app applied them in), and only then answered."""

    def __init__(self, app, root: Path):
        self.app, self.root = app, root
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)
        self._restore()

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] not in ("PUT", "POST", "DELETE"):
            return self.app(environ, start_response)
        body = get_input_stream(environ).read()
        environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(body), str(len(body))
        with self._lock:
            status, headers, content = self._call(environ)
            if int(status[:3]) < 300:
                self._mirror(environ, body)
        start_response(status, headers)
        return [content]

    def _call(self, environ) -> tuple[str, list, bytes]:
        answer: dict = {}

        def start_response(status, headers, exc_info=None):
            answer.update(status=status, headers=headers)
            return lambda data: None  # moto's app writes nothing through write()

        result = self.app(environ, start_response)
        try:
            content = b"".join(result)
        finally:
            getattr(result, "close", lambda: None)()
        return answer["status"], answer["headers"], content

    # ------------------------------------------------------------ mirror

    def _mirror(self, environ, body: bytes) -> None:
        bucket, _, key = _wsgi_path(environ).lstrip("/").partition("/")
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        method = environ["REQUEST_METHOD"]
        if not bucket:
            return
        if key:
            if "uploads" in query or ("uploadId" in query and method != "POST"):
                return  # a multipart upload begins, takes a part or is aborted: no object changed yet
            self._mirror_key(bucket, key)
        elif method == "POST" and "delete" in query:  # DeleteObjects
            for element in ET.fromstring(body).iter():
                if element.tag.rsplit("}", 1)[-1] == "Key":
                    self._mirror_key(bucket, element.text or "")
        elif not query and method == "PUT":
            (self.root / bucket).mkdir(exist_ok=True)
        elif not query and method == "DELETE":
            shutil.rmtree(self.root / bucket, ignore_errors=True)

    def _mirror_key(self, bucket: str, key: str) -> None:
        """Writes what the app now holds under `key` (or removes the file when it holds nothing)."""
        path = self.root / bucket / (hashlib.sha256(key.encode()).hexdigest() + _SUFFIX)
        status, headers, content = self._call(EnvironBuilder(path=_quote(bucket, key), method="GET",
                                                             headers=_AUTH).get_environ())
        if status.startswith("404"):
            path.unlink(missing_ok=True)
            return
        if not status.startswith("200"):
            raise RuntimeError(f"reading s3://{bucket}/{key} back to mirror it answered {status}")
        kept = {name.lower(): value for name, value in headers
                if name.lower() in _KEPT_HEADERS or name.lower().startswith("x-amz-meta-")}
        path.parent.mkdir(exist_ok=True)
        temporary = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        with open(temporary, "wb") as f:
            f.write(json.dumps({"key": key, "headers": kept}).encode() + b"\n")
            f.write(content)
        os.replace(temporary, path)

    # ------------------------------------------------------------ restore

    def _restore(self) -> None:
        for bucket_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            self._put(_quote(bucket_dir.name, ""), b"", {})
            for path in bucket_dir.iterdir():
                if path.name.endswith(".tmp"):  # a write the crash interrupted, never acknowledged
                    path.unlink()
                elif path.name.endswith(_SUFFIX):
                    with open(path, "rb") as f:
                        header = json.loads(f.readline())
                        self._put(_quote(bucket_dir.name, header["key"]), f.read(), header["headers"])

    def _put(self, path: str, data: bytes, headers: dict[str, str]) -> None:
        status, _, content = self._call(EnvironBuilder(path=path, method="PUT", data=data,
                                                       headers={**_AUTH, **headers}).get_environ())
        if int(status[:3]) >= 300:
            raise RuntimeError(f"restoring {path} answered {status}: {content[:300]!r}")


def _wsgi_path(environ) -> str:
    """PATH_INFO holds the path's bytes as latin-1 (PEP 3333); keys are UTF-8."""
    return environ.get("PATH_INFO", "").encode("latin-1").decode("utf-8", "replace")


def _quote(bucket: str, key: str) -> str:
    return "/" + quote(bucket) + ("/" + quote(key, safe="/") if key else "")


def serve(port: int, data_dir: Path | None, host: str = "127.0.0.1") -> None:
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import make_server

    app = s3_app() if data_dir is None else DurableS3(s3_app(), data_dir)
    make_server(host, port, app, threaded=True, request_handler=MotoRequestHandler).serve_forever()


def _main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (loopback unless told).")
    parser.add_argument("--data-dir", type=Path, default=None, help="Keep objects here (durable); else in memory.")
    args = parser.parse_args(argv)
    serve(args.port, args.data_dir, args.host)


if __name__ == "__main__":
    _main()
