"""`moetune up` / `moetune down` (service/local/stack.py): a local stack that stays up between commands."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from moetune.service.local import stack as local_stack

_STATE_DIR = click.option("--state-dir", default=str(local_stack.STATE_DIR), show_default=True,
                          type=click.Path(file_okay=False, path_type=Path), help="Where the stack keeps its state.")


@click.command()
@click.option("--with-demo-assets", is_flag=True,
              help="Generate the tiny demo model and datasets into s3://moetune-demo/ (registered as "
                   "tiny-kimi-k3).")
@click.option("--ray-address", default=None, help="Use this Ray cluster's Jobs API instead of starting a head.")
@click.option("--num-cpus", default=None, type=click.IntRange(1), help="Logical CPUs of the local Ray head.")
@click.option("--tenant", "tenants", multiple=True, metavar="NAME",
              help="Add a tenant with a token of its own (repeatable; kept for later ups). Tokens already in "
                   "MOETUNE_API_TOKENS are kept too.")
@_STATE_DIR
def up(with_demo_assets: bool, ray_address: str | None, num_cpus: int | None, tenants: tuple[str, ...],
       state_dir: Path) -> None:
    """Start the embedded stack (S3 server, Ray head, control plane, SQLite) in the background, or bring back
    the components that died (same ports and data); data kept in STATE_DIR."""
    from moetune.service.local.demo import BUCKET, MODELS, make_demo_assets

    bases = {MODELS[False]: f"s3://{BUCKET}/models/{MODELS[False]}"} if with_demo_assets else None
    stack = local_stack.up(state_dir, ray_address=ray_address, num_cpus=num_cpus, base_models=bases,
                           tenants=tenants)
    if with_demo_assets:
        with tempfile.TemporaryDirectory(prefix="moetune-assets-") as work:
            make_demo_assets(Path(work), stack.s3_endpoint, images=False)
        click.echo(f"demo assets: model {MODELS[False]} (s3://{BUCKET}/models/{MODELS[False]}), "
                   f"s3://{BUCKET}/data/train.jsonl and valid.jsonl")
    done = stack.last_up
    state = "already up" if set(done.values()) == {"adopted"} else "up"
    click.echo(f"{state}: control plane {stack.url} (token {stack.token}), S3 {stack.s3_endpoint}, "
               f"Ray {stack.ray_address}; logs in {state_dir / 'logs'}")
    click.echo(f"web console: {stack.url}/console (sign in with a token above)")
    click.echo("components: " + ", ".join(f"{role} {what} (pid {stack.pids[role]})" for role, what in done.items()))
    for name, token in stack.tenants.items():
        click.echo(f"tenant {name}: token {token}")
    click.echo("moetune commands in this directory find it; elsewhere export:")
    for name, value in stack.env().items():
        click.echo(f"export {name}={value}")


@click.command()
@_STATE_DIR
def down(state_dir: Path) -> None:
    """Stop the stack `moetune up` started, keeping its data for the next `up`."""
    if local_stack.down(state_dir):
        click.echo(f"down; data kept in {state_dir}")
    else:
        click.echo("nothing was up")
