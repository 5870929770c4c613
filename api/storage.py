"""Object storage through fsspec for any URI the API accepts (s3://, file://, memory://).

S3 goes to the endpoint in MOETUNE_S3_ENDPOINT_URL when set (MinIO, Ceph, R2, the embedded
server), with credentials from the standard AWS environment.
"""

from __future__ import annotations

import os

import fsspec

from moetune.api.models import ENV_S3_ENDPOINT_URL


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for `uri` and the path inside it."""
    fs, path = fsspec.core.url_to_fs(uri, **_options(uri))
    return fs, path


def _options(uri: str) -> dict:
    endpoint = os.environ.get(ENV_S3_ENDPOINT_URL)
    if uri.startswith("s3://") and endpoint:
        return {"endpoint_url": endpoint}
    if uri.startswith("file://"):
        return {"auto_mkdir": True}  # object stores have no folders to create first; make local ones behave alike
    return {}


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    return fs.cat_file(path)


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_bytes(uri: str, data: bytes) -> None:
    fs, path = filesystem(uri)
    fs.pipe_file(path, data)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)


def download_dir(uri: str, local_dir: str, skip=None) -> str:
    """Copies every file under `uri` into `local_dir` (kept relative layout); returns local_dir.
    `skip(relative path)` true leaves a file out (e.g. the weights, which are streamed instead)."""
    fs, root = filesystem(uri)
    root = root.rstrip("/")
    files = [p for p in fs.find(root) if p != root and not (skip and skip(os.path.relpath(p, root)))]
    if not files:
        raise FileNotFoundError(f"{uri} holds no files")
    for remote in files:
        local = os.path.join(local_dir, os.path.relpath(remote, root))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        fs.get_file(remote, local)
    return local_dir


def upload_dir(local_dir: str, uri: str) -> list[str]:
    """Copies every file under `local_dir` to `uri`; returns the URIs written."""
    fs, root = filesystem(uri)
    written = []
    for dirpath, _, names in os.walk(local_dir):
        for name in sorted(names):
            local = os.path.join(dirpath, name)
            rel = os.path.relpath(local, local_dir).replace(os.sep, "/")
            fs.put_file(local, f"{root.rstrip('/')}/{rel}")
            written.append(join(uri, rel))
    return written
