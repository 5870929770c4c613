"""`moetune data upload|make-bucket`: put a JSONL file where jobs can name it (the control plane's /v1/files,
rows checked on upload), and create a bucket (s3:// uses MOETUNE_S3_ENDPOINT_URL and the AWS_* credentials)."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from moetune.api import storage
from moetune.api.client import Client


@click.group()
def data() -> None:
    """Training data files and buckets."""


class _ReadCounter(io.FileIO):
    """The file as the HTTP client reads it into the request body (in pieces: the file is never held whole),
    telling `on_read` each piece's size."""

    def __init__(self, path: Path, on_read: Callable[[int], None]):
        super().__init__(path, "rb")
        self._on_read = on_read

    def read(self, size: int = -1) -> bytes:
        piece = super().read(size)
        self._on_read(len(piece))
        return piece


@data.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.pass_context
def upload(ctx: click.Context, path: Path) -> None:
    """Upload the JSONL file PATH (purpose fine-tune); prints its id, which a job names as training_file. On a
    terminal, stderr shows the bytes sent so far out of the file's size (nothing there when redirected)."""
    obj = ctx.find_root().obj
    console = Console(stderr=True)
    columns = (TextColumn(f"Uploading {path.name}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        sent = progress.add_task("upload", total=path.stat().st_size)
        with _ReadCounter(path, lambda n: progress.advance(sent, n)) as body:
            uploaded = Client(obj["url"], obj["token"]).files.create(body, path.name)
    click.echo(f"{uploaded.id} {uploaded.filename} ({uploaded.rows} rows, {uploaded.bytes} bytes)")


@data.command("make-bucket")
@click.argument("uri")
def make_bucket(uri: str) -> None:
    """Create the bucket of URI (e.g. s3://moetune) when it does not exist."""
    if not uri.startswith("s3://"):
        raise click.ClickException(f"{uri}: only s3:// URIs have buckets")
    try:
        storage.make_bucket(uri)
    except OSError as e:
        raise click.ClickException(f"{uri}: {e}") from None
    click.echo(f"{uri.split('/')[2]} is ready")
