"""Object storage through fsspec for any URI the API accepts (s3://, file://, memory://): the one storage
adapter of the workers, the control plane and the demo. It imports no torch.

S3 goes to an S3-compatible endpoint (MinIO, Ceph, R2, the embedded server) when one is given, with
credentials from the standard AWS environment. Every function takes `endpoint_url`: left out, it is the
MOETUNE_S3_ENDPOINT_URL environment value (what the workers use); passed, it is that endpoint, and None means
AWS itself (the control plane passes its setting, whatever the environment says).
"""

from __future__ import annotations

import os
from typing import Final

import fsspec

from moetune.api.environment import ENV_S3_ENDPOINT_URL


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV: Final = _FromEnv()  # `endpoint_url` default: the MOETUNE_S3_ENDPOINT_URL environment value
Endpoint = str | None | _FromEnv


def filesystem(uri: str, endpoint_url: Endpoint = FROM_ENV, *, quick: bool = False,
               listings_cache: bool = True) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for `uri` and the path inside it.

    quick: short S3 timeouts and no retries (for reads inside a request). listings_cache=False: every listing
    asks the store (an object uploaded after a first failed check is seen on the next one).
    """
    fs, path = fsspec.core.url_to_fs(uri, **storage_options(uri, endpoint_url, quick=quick,
                                                            listings_cache=listings_cache))
    return fs, path


def storage_options(uri: str, endpoint_url: Endpoint = FROM_ENV, *, quick: bool = False,
                    listings_cache: bool = True) -> dict:
    """The fsspec options `filesystem` opens `uri` with."""
    if uri.startswith("s3://"):
        endpoint = os.environ.get(ENV_S3_ENDPOINT_URL) if isinstance(endpoint_url, _FromEnv) else endpoint_url
        options: dict = {}
        if endpoint:
            options["endpoint_url"] = endpoint
        if not listings_cache:
            options["use_listings_cache"] = False
        if quick:  # inside a request: give up fast rather than hold the client through retries
            # a new dict each time: botocore rewrites the "retries" one it is given
            options["config_kwargs"] = {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}
        return options
    if uri.startswith("file://"):
        return {"auto_mkdir": True}  # object stores have no folders to create first; make local ones behave alike
    return {}


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def read_bytes(uri: str, *, endpoint_url: Endpoint = FROM_ENV) -> bytes:
    fs, path = filesystem(uri, endpoint_url)
    return fs.cat_file(path)


def read_text(uri: str, *, endpoint_url: Endpoint = FROM_ENV) -> str:
    return read_bytes(uri, endpoint_url=endpoint_url).decode("utf-8")


def write_bytes(uri: str, data: bytes, *, endpoint_url: Endpoint = FROM_ENV) -> None:
    fs, path = filesystem(uri, endpoint_url)
    fs.pipe_file(path, data)


class StagedWrite:
    """One object written in pieces as they arrive: nothing is visible at `uri` until commit(), and discard()
    leaves nothing there. On S3 it is a multipart upload of `part_bytes` parts, so memory stays near one part
    whatever the object's size (s3fs's default part is 50 MiB)."""

    def __init__(self, uri: str, *, endpoint_url: Endpoint = FROM_ENV, part_bytes: int = 8 * 2**20):
        fs, path = filesystem(uri, endpoint_url)
        self._file = fs.open(path, "wb", block_size=part_bytes, autocommit=False)

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def commit(self) -> None:
        self._file.close()
        self._file.commit()

    def discard(self) -> None:
        """Aborts the write (S3: the multipart upload and its parts); a storage error here propagates."""
        try:
            self._file.close()  # fsspec discards only a closed file (S3 uploads the buffered tail, then aborts)
        finally:
            self._file.discard()


def check_writable(uri: str, *, endpoint_url: Endpoint = FROM_ENV, quick: bool = False) -> None:
    """Writes and deletes one empty probe object under `uri`: FileNotFoundError when its bucket does not exist,
    PermissionError when writing there is denied (other storage errors propagate as they are)."""
    fs, path = filesystem(uri, endpoint_url, quick=quick)
    probe = f"{path.rstrip('/')}/.moetune-write-check-{os.urandom(6).hex()}"
    fs.pipe_file(probe, b"")
    fs.rm_file(probe)


def exists(uri: str, *, endpoint_url: Endpoint = FROM_ENV) -> bool:
    fs, path = filesystem(uri, endpoint_url)
    return fs.exists(path)


def download_dir(uri: str, local_dir: str, skip=None, *, endpoint_url: Endpoint = FROM_ENV) -> str:
    """Copies every file under `uri` into `local_dir` (kept relative layout); returns local_dir.
    `skip(relative path)` true leaves a file out (e.g. the weights, which are streamed instead)."""
    fs, root = filesystem(uri, endpoint_url)
    root = root.rstrip("/")
    files = [p for p in fs.find(root) if p != root and not (skip and skip(os.path.relpath(p, root)))]
    if not files:
        raise FileNotFoundError(f"{uri} holds no files")
    for remote in files:
        local = os.path.join(local_dir, os.path.relpath(remote, root))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        fs.get_file(remote, local)
    return local_dir


def upload_dir(local_dir: str, uri: str, *, endpoint_url: Endpoint = FROM_ENV) -> list[str]:
    """Copies every file under `local_dir` to `uri`; returns the URIs written."""
    fs, root = filesystem(uri, endpoint_url)
    written = []
    for dirpath, _, names in os.walk(local_dir):
        for name in sorted(names):
            local = os.path.join(dirpath, name)
            rel = os.path.relpath(local, local_dir).replace(os.sep, "/")
            fs.put_file(local, f"{root.rstrip('/')}/{rel}")
            written.append(join(uri, rel))
    return written


def make_bucket(uri: str, *, endpoint_url: Endpoint = FROM_ENV) -> None:
    """Creates the bucket of an s3:// URI (s3fs creates one with mkdir); nothing for other schemes."""
    if uri.startswith("s3://"):
        fs, path = filesystem(uri, endpoint_url)
        bucket = path.split("/", 1)[0]
        if not fs.exists(bucket):
            fs.mkdir(bucket)
