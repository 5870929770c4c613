"""`moetune models push|inspect`: put a Hugging Face checkpoint into object storage for streaming, and see
what each expert-parallel rank would read. The training stack is imported inside the commands only."""

from __future__ import annotations

import json
import os
import re

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from moetune.api import storage

console = Console()
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise click.BadParameter(f"{text!r} is no size (e.g. 5GB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def check_destination(uri: str) -> None:
    """A one-line error naming the bucket before anything is read or uploaded."""
    try:
        storage.check_writable(uri)
    except FileNotFoundError:
        bucket = uri.split("://", 1)[-1].split("/", 1)[0]
        raise click.ClickException(f"{uri}: the bucket {bucket!r} does not exist (create it with `moetune data "
                                   f"make-bucket s3://{bucket}`)") from None
    except PermissionError:
        raise click.ClickException(f"{uri}: writing there was denied") from None
    except (OSError, ValueError) as e:
        raise click.ClickException(f"{uri}: {e}") from None


@click.group()
def models() -> None:
    """Checkpoints in object storage (s3:// uses MOETUNE_S3_ENDPOINT_URL and the AWS_* credentials)."""


@models.command()
@click.argument("local_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("uri")
@click.option("--shard-size", default="4GiB", show_default=True, help="Largest shard written (e.g. 512MiB, 5GB).")
def push(local_dir: str, uri: str, shard_size: str) -> None:
    """Upload LOCAL_HF_DIR to URI: shards re-cut so each expert's slice is contiguous, with a checksum manifest."""
    check_destination(uri)  # before the training stack's imports: a wrong bucket answers at once
    from moetune.workers.errors import JobError
    from moetune.workers.weights.loader import is_weight_file
    from moetune.workers.weights.push import local_tensors
    from moetune.workers.weights.push import push as push_checkpoint

    try:
        total = sum(info.nbytes for _, info in local_tensors(local_dir).values())
    except (JobError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    total += sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(local_dir) for n in names
                 if not is_weight_file(n))
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console) as bar:
        task = bar.add_task("push", total=total)
        try:
            done = push_checkpoint(local_dir, uri, _size(shard_size),
                                   lambda what, n: bar.update(task, advance=n, description=what))
        except (JobError, FileNotFoundError) as e:
            raise click.ClickException(str(e)) from None
    console.print(f"pushed {done['tensors']} tensors ({done['bytes'] / 2**30:.2f} GiB) in {done['shards']} shards "
                  f"to {uri}, with moetune-manifest.json")


@models.command()
@click.argument("uri")
@click.option("--ep", default=1, show_default=True, type=click.IntRange(1), help="Expert-parallel size to plan for.")
@click.option("--lora", "targets", default=None,
              help="LoRA targets: a preset (all-linear, attention, mlp, experts) or comma-separated module names; "
                   "prints which modules of each layer type they adapt.")
@click.option("--train-experts", is_flag=True, help="With --lora: routed experts get LoRA too (lora.train_experts).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(uri: str, ep: int, targets: str | None, train_experts: bool, as_json: bool) -> None:
    """Family, parameter counts, experts and bytes each rank reads at EP=N, from headers only."""
    from pydantic import ValidationError

    from moetune.api.models.lora import LoraSpec
    from moetune.workers.errors import JobError
    from moetune.workers.weights.push import inspect as inspect_checkpoint

    lora = None
    if targets is not None:
        names = targets if targets in ("all-linear", "attention", "mlp", "experts") else targets.split(",")
        try:
            lora = LoraSpec(target_modules=names, train_experts=train_experts)
        except ValidationError as e:
            raise click.BadParameter(e.errors()[0]["msg"], param_hint="--lora") from None

    with Progress(TextColumn("reading shard headers"), BarColumn(), TextColumn("{task.completed} shards"),
                  console=console, transient=True) as bar:
        task = bar.add_task("headers", total=None)
        try:
            report = inspect_checkpoint(uri, ep, progress=lambda shard: bar.advance(task), lora=lora)
        except JobError as e:
            raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(report))
        return
    table = Table(show_header=False)
    for key in ("uri", "model_type", "quantization", "parameters", "expert_parameters", "moe_layers",
                "experts_per_layer", "checkpoint_bytes", "manifest"):
        table.add_row(key, f"{report[key]:,}" if isinstance(report[key], int) and not isinstance(report[key], bool)
                      else str(report[key]))
    for rank, n in enumerate(report["bytes_per_rank"]):
        table.add_row(f"rank {rank} of EP={ep} reads", f"{n:,} bytes ({n / report['checkpoint_bytes']:.1%})")
    console.print(table)
    if report["lora"]:
        _print_lora(report["lora"], report["parameters"])


def _print_lora(lora: dict, parameters: int) -> None:
    table = Table("layer type", "layers adapted", "LoRA on", "not adapted", "trainable", title="LoRA coverage")
    for row in lora["rows"]:
        table.add_row(row["layer_type"], f"{row['adapted_layers']}/{row['layers']}", ", ".join(row["adapted"]) or "-",
                      ", ".join(row["not_adapted"]) or "-", f"{row['trainable_parameters']:,}")
    console.print(table)
    share = lora["trainable_parameters"] / max(parameters, 1)
    console.print(f"{lora['trainable_parameters']:,} trainable parameters ({share:.4%} of {parameters:,})")
    for warning in lora["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")
