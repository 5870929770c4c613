"""The S3 requests the loader makes itself rather than through fsspec's file API, each call one hop from the
calling thread to fsspec's event loop (a thread switch both ways): a small object whole in one GET (s3fs asks for
its size first), a ranged GET's body read straight into memory views, and a shard's first bytes together with
its ETag and size in one GET."""

from __future__ import annotations


def is_s3(fs) -> bool:
    return hasattr(fs, "_call_s3")


async def _get(fs, path: str, start: int | None = None, end: int | None = None):
    """The response to a GET of `path` (bytes [start, end) when given)."""
    bucket, key, version = fs.split_path(path)
    return await fs._call_s3("get_object", Bucket=bucket, Key=key,
                             **({"Range": f"bytes={start}-{end - 1}"} if start is not None else {}),
                             **({"VersionId": version} if version else {}))


async def _read(fs, path: str, start: int | None = None, end: int | None = None):
    """(the response, its whole body) of a GET of `path` (bytes [start, end) when given)."""
    response = await _get(fs, path, start, end)
    try:
        return response, await response["Body"].read()
    finally:
        response["Body"].close()


def read_object(fs, path: str) -> bytes:
    """The whole object at `path` in one GET (FileNotFoundError when there is none)."""
    from fsspec.asyn import sync

    return sync(fs.loop, _read, fs, path)[1]


async def _read_into(body, views: list[memoryview]) -> int:
    total = 0
    for view in views:
        filled = 0
        while filled < len(view) and (n := await body.readinto(view[filled:])):
            filled += n
        total += filled
        if filled < len(view):
            break
    return total


class LoopBody:
    """The open body of a ranged GET through fsspec's client (workers.weights.direct reads without it)."""

    def __init__(self, fs, path: str, start: int, end: int):
        from fsspec.asyn import sync

        self.fs, self.sync = fs, sync
        self.body = sync(fs.loop, _get, fs, path, start, end)["Body"]

    def read_into(self, views: list[memoryview]) -> int:
        """Fills `views` in order, each straight from the client's receive buffer (no block-sized copy in
        between); returns the bytes read (fewer where the response ended early)."""
        return self.sync(self.fs.loop, _read_into, self.body, views)

    def close(self) -> None:
        self.body.close()


async def _head(fs, path: str, nbytes: int):
    response, data = await _read(fs, path, 0, nbytes)
    total = response.get("ContentRange", "").rpartition("/")[2]
    return response["ETag"], int(total) if total.isdigit() else response["ContentLength"], data


def object_head(fs, path: str, nbytes: int) -> tuple[str, int, bytes]:
    """(ETag, size, the first `nbytes` bytes or the whole object if smaller) of `path`, in one request: what a
    HEAD and a ranged GET would tell, one round trip sooner."""
    from fsspec.asyn import sync

    return sync(fs.loop, _head, fs, path, nbytes)
