"""The `moetune` command: run the control plane, submit and follow jobs, run the demo."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import webbrowser
from datetime import UTC, datetime
from pathlib import Path

import click
import httpx
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Column, Table

from moetune.api.client import APIError, Client
from moetune.api import storage
from moetune.api.model_names import derive_base_name
from moetune.api.models.base import SpecError
from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.api.models.responses import JobStatus
from moetune.api.plans import ClusterSpec, parse_cluster
from moetune.service.cli import serve as serve_commands, up as up_commands
from moetune.service.cli.data import data
from moetune.service.cli.models import models
from moetune.service.cli.output import print_whole
from moetune.service.cli.plan_view import print_plan
from moetune.service.cli.progress import follow
from moetune.service.cli.report_view import compare_table
from moetune.service.cli.sessions import sessions
from moetune.service.cli.spec_errors import explain
from moetune.service.cli.webhooks import webhooks
from moetune.service.local import stack as local_stack

console = Console()


def _client(ctx: click.Context) -> Client:
    return Client(ctx.obj["url"], ctx.obj["token"])


def _when(ts: int | None) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _exit_for(job) -> None:
    sys.exit(0 if job.status == JobStatus.succeeded else 1)


class _FriendlyErrors(click.Group):
    """API errors and unreachable servers become one clear line, not a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except APIError as e:
            where = f" ({e.param})" if e.param else ""
            raise click.ClickException(f"{e.status_code} {e.code}{where}: {e.message}") from None
        except (OSError, httpx.TransportError) as e:  # connection refused, DNS, timeouts
            server, stack = _server_of(e, ctx), (ctx.obj or {}).get("stack")
            if stack is not None and server == stack.url:  # the URL came from ./.moetune: the stack is down
                raise click.ClickException(local_stack.down_message()) from None
            raise click.ClickException(f"cannot reach the control plane at {server}: {e}") from None


def _server_of(error: Exception, ctx) -> str:
    """The server the failed request went to (`demo` runs its own control plane), else the configured URL."""
    try:
        url = error.request.url
    except (AttributeError, RuntimeError):  # not an httpx error, or one raised before its request existed
        return (ctx.obj or {}).get("url", "")
    return f"{url.scheme}://{url.netloc.decode()}"


@click.group(cls=_FriendlyErrors)
@click.version_option(package_name="moetune", prog_name="moetune")
@click.option("--url", envvar="MOETUNE_URL", default=None,
              help="Control plane base URL [default: the `moetune up` stack of this directory, else "
                   f"{local_stack.DEFAULT_URL}].")
@click.option("--token", envvar="MOETUNE_TOKEN", default=None,
              help=f"API bearer token [default: that stack's, else {local_stack.DEFAULT_TOKEN}].")
@click.pass_context
def main(ctx: click.Context, url: str | None, token: str | None) -> None:
    """moetune: LoRA fine-tuning of very large Mixture-of-Experts models on Ray + DeepSpeed."""
    url, token, stack = local_stack.connection(url, token)
    ctx.obj = {"url": url, "token": token, "stack": stack}
    if stack is not None and local_stack.running(stack):  # deploy's Ray address, chat's Serve app, S3 credentials
        for name, value in stack.env().items():
            os.environ.setdefault(name, value)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="'warning' drops the access log.")
def server(host: str, port: int, log_level: str) -> None:
    """Run the control plane (settings from MOETUNE_* environment variables)."""
    import uvicorn

    from moetune.service.app import create_app  # only this command loads the server

    uvicorn.run(create_app(), host=host, port=port, log_level=log_level)


@main.command()
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--follow/--no-follow", default=False, help="Show progress until the job ends.")
@click.option("--idempotency-key", default=None, help="Submitting twice with the same key returns the same job.")
@click.option("--timeout", default=86400.0, show_default=True, help="Seconds to follow before giving up.")
@click.pass_context
def submit(ctx: click.Context, spec_file: Path, follow: bool, idempotency_key: str | None, timeout: float) -> None:
    """Submit the job described by SPEC_FILE (YAML or JSON with the fields of POST /v1/fine_tuning/jobs)."""
    spec = _read_spec(spec_file)
    client = _client(ctx)
    job = client.jobs.create(spec, idempotency_key=idempotency_key)
    console.print(f"submitted [bold]{job.id}[/] ({job.status})")
    if follow:
        _follow(client, job.id, timeout)


def _read_spec(spec_file: Path) -> JobCreate:
    try:
        return JobCreate.model_validate(yaml.safe_load(spec_file.read_text()) or {})
    except yaml.YAMLError as e:
        raise click.ClickException(f"{spec_file}: {e}") from None
    except ValidationError as e:
        raise click.ClickException(explain(str(spec_file), e, JobCreate)) from None


def _follow(client: Client, job_id: str, timeout: float) -> None:
    job, _ = follow(client, job_id, timeout=timeout, console=console)
    console.print(f"{job.id}: [bold]{job.status}[/]" + (f" -> {job.fine_tuned_model}" if job.fine_tuned_model else ""))
    if job.error:
        console.print(f"[red]{job.error.code}: {job.error.message}")
    _exit_for(job)


@main.group()
def jobs() -> None:
    """List, inspect, cancel and follow jobs."""


@jobs.command("list")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 100))
@click.option("--after", default=None, help="Cursor: list jobs older than this job id.")
@click.pass_context
def jobs_list(ctx: click.Context, limit: int, after: str | None) -> None:
    """The newest jobs: id, status, step, training loss, when created, base model."""
    page = _client(ctx.parent).jobs.list(after=after, limit=limit)
    rows = [(job.id, job.status, f"{job.progress.step}/{job.progress.total_steps or '?'}",
             f"{job.progress.train_loss:.3f}" if job.progress.train_loss is not None else "-",
             datetime.fromtimestamp(job.created_at, UTC).strftime("%m-%d %H:%M"), derive_base_name(job.model))
            for job in page.data]
    # Fits 80 columns: no borders; ids, statuses and numbers keep their full width (ids stay copy-pasteable), the
    # model's short name takes what is left.
    fixed = [Column(name, no_wrap=True, min_width=max([len(name), *(len(row[i]) for row in rows)]))
             for i, name in enumerate(("id", "status", "step", "loss", "created"))]
    room = console.width - sum(column.min_width for column in fixed) - len(fixed)
    table = Table(*fixed, Column("model", no_wrap=True, overflow="ellipsis", max_width=max(room, 1)), box=None,
                  pad_edge=False, collapse_padding=True)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if page.has_more:
        console.print(f"more: --after {page.last_id}")


@jobs.command("get")
@click.argument("job_id")
@click.pass_context
def jobs_get(ctx: click.Context, job_id: str) -> None:
    """The job as JSON (GET /v1/fine_tuning/jobs/{id}): status, progress, error, tuned model's name."""
    click.echo(json.dumps(_client(ctx.parent).jobs.retrieve(job_id).model_dump(mode="json"), indent=2))


@jobs.command("report")
@click.argument("job_id")
@click.option("--output", "output_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder to write report.json and report.html into (default: ./<job id>-report).")
@click.option("--open", "open_page", is_flag=True, help="Open report.html in the web browser.")
@click.pass_context
def jobs_report(ctx: click.Context, job_id: str, output_dir: Path | None, open_page: bool) -> None:
    """Download the adaptation report of a job that succeeded."""
    client = _client(ctx.parent)
    report, page = client.jobs.report(job_id), client.jobs.report_html(job_id)
    output_dir = output_dir or Path(f"{job_id}-report")
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "report.json").write_text(report.model_dump_json(indent=1))
    (output_dir / "report.html").write_text(page)
    click.echo(f"{output_dir / 'report.json'}\n{output_dir / 'report.html'}")
    if open_page:
        webbrowser.open((output_dir / "report.html").resolve().as_uri())


@jobs.command("compare")
@click.argument("job_a")
@click.argument("job_b")
@click.pass_context
def jobs_compare(ctx: click.Context, job_a: str, job_b: str) -> None:
    """Two jobs' adaptation reports side by side: loss at the steps both ran, evaluation, throughput, memory."""
    client = _client(ctx.parent)
    print_whole(console, compare_table(client.jobs.report(job_a), client.jobs.report(job_b)))


@jobs.command("cancel")
@click.argument("job_id")
@click.pass_context
def jobs_cancel(ctx: click.Context, job_id: str) -> None:
    """Stop a job that has not finished (status cancelled; the scheduler stops its Ray job)."""
    _print_status(_client(ctx.parent).jobs.cancel(job_id))


@jobs.command("pause")
@click.argument("job_id")
@click.pass_context
def jobs_pause(ctx: click.Context, job_id: str) -> None:
    """Checkpoint a running job and release its workers (status pausing, then paused)."""
    _print_status(_client(ctx.parent).jobs.pause(job_id))


@jobs.command("resume")
@click.argument("job_id")
@click.pass_context
def jobs_resume(ctx: click.Context, job_id: str) -> None:
    """Queue a paused job again; it continues from its last checkpoint."""
    _print_status(_client(ctx.parent).jobs.resume(job_id))


def _print_status(job) -> None:
    console.print(f"{job.id}: {job.status}")


@jobs.command("events")
@click.argument("job_id")
@click.option("--follow", is_flag=True, help="Stream events live and show progress until the job ends.")
@click.option("--timeout", default=86400.0, show_default=True)
@click.pass_context
def jobs_events(ctx: click.Context, job_id: str, follow: bool, timeout: float) -> None:
    """The job's event log, oldest first: phases, metrics, warnings, errors."""
    client = _client(ctx.parent)
    if follow:
        _follow(client, job_id, timeout)
    for ev in client.jobs.events_since(job_id):  # oldest first, as a log reads
        console.print(f"{_when(ev.created_at)} {ev.level:5} {ev.message}", markup=False, highlight=False)


@main.command()
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--cluster", "cluster_text", required=True,
              help="The GPUs, e.g. nodes=8,gpus_per_node=8,gpu_memory=140GiB,nic=400Gbps. gpu_memory is one GPU's "
                   "memory as the device reports it, in GiB (2^30 bytes; nvidia-smi's MiB / 1024, an H200's 140): a "
                   "bare number or G means GiB, GB means 10^9 bytes. The step-time estimates take gpu_tflops (dense "
                   "bf16 peak, default 989), efficiency (share of it reached, default 0.4), nvlink (each way, "
                   "default 450GB/s), network (a GPU's link to other nodes, default 400Gbps) and overlap (default "
                   "true: ZeRO-3's gathers overlap the compute).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (the only thing on stdout).")
def plan(spec_file: Path, cluster_text: str, as_json: bool) -> None:
    """Per-GPU memory of the job in SPEC_FILE on a cluster, the fastest layout that fits (estimated) and the fewest
    GPUs any layout fits on (model built on the meta device from its config.json, in this process: it needs the
    training stack installed; nothing is submitted, no control plane is asked)."""
    spec = _read_spec(spec_file)
    try:
        cluster = parse_cluster(cluster_text)
    except ValidationError as e:
        raise click.ClickException(explain("--cluster", e, ClusterSpec)) from None
    except ValueError as e:
        raise click.ClickException(f"--cluster: {e}") from None
    # stdout carries the plan alone: what the training stack prints as it loads (DeepSpeed's "Setting accelerator
    # to CPU" goes to stdout, through a handler bound to the stdout of its import) goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        from moetune.workers.errors import JobError
        from moetune.workers.planner.plan import plan as plan_job

        try:
            job = resolve_run_config(spec, spec.seed or 0, planning=True)  # the seed changes no byte of the plan
            config = json.loads(storage.read_text(storage.join(spec.model, "config.json")))
            result = plan_job(config, job, cluster, spec.training.activation_checkpointing == "auto")
        except SpecError as e:  # the message names its field, or is about the field in `param`
            where = "" if e.message.startswith(e.param) else f"{e.param}: "
            raise click.ClickException(f"{spec_file}: {where}{e.message}") from None
        except (OSError, ValueError, JobError) as e:  # storage, config.json not JSON, the model
            raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(result.model_dump_json())
        return
    print_plan(console, result)


@main.command()
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the demo job.")
@click.option("--images", is_flag=True, help="Train a tiny vision-language model on image rows.")
def demo(timeout: float, images: bool) -> None:
    """Run one tiny job end to end on the embedded default (loopback S3, local Ray, SQLite, CPU)."""
    from moetune.service.local.demo import run_demo  # it runs a control plane in this process

    sys.exit(run_demo(timeout=timeout, images=images))


main.add_command(models)
main.add_command(serve_commands.serve)
main.add_command(serve_commands.chat)
models.add_command(serve_commands.download)
jobs.add_command(serve_commands.deploy)
main.add_command(data)
main.add_command(webhooks)
main.add_command(sessions)
main.add_command(up_commands.up)
main.add_command(up_commands.down)
