"""`moetune data upload|make-bucket`: put a JSONL file where jobs can name it (the control plane's /v1/files,
rows checked on upload), and create a bucket (s3:// uses MOETUNE_S3_ENDPOINT_URL and the AWS_* credentials)."""

from __future__ import annotations

from pathlib import Path

import click

from moetune.api import storage
from moetune.api.client import Client


@click.group()
def data() -> None:
    """Training data files and buckets."""


@data.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.pass_context
def upload(ctx: click.Context, path: Path) -> None:
    """Upload the JSONL file PATH (purpose fine-tune); prints its id, which a job names as training_file."""
    obj = ctx.find_root().obj
    uploaded = Client(obj["url"], obj["token"]).files.create(path.read_bytes(), path.name)
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
