"""`moetune sessions create|list|get|close|restart`: training sessions (POST /v1/training_sessions); their calls
come from the user's own loop through the SDK (moetune.api.training)."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from moetune.api.client import Client
from moetune.api.models.training_sessions import TrainingSession
from moetune.api.training import Training
from moetune.service.cli.output import print_whole

console = Console()


def _training(obj: dict) -> Training:
    return Training(Client(obj["url"], obj["token"]))


def _show(session: TrainingSession) -> None:
    why = f" ({session.close_reason})" if session.close_reason else ""
    error = f": {session.error.message}" if session.error else ""
    console.print(f"{session.id} [bold]{session.status}[/]{why}{error} on {session.model}; states and weights "
                  f"under {session.output_uri}; {session.restarts} restarts", highlight=False, soft_wrap=True)


@click.group()
def sessions() -> None:
    """Worker groups holding a LoRA for your own training loop (RL): forward_backward, optim_step, sample."""


@sessions.command("create")
@click.option("--model", required=True, help="A registered base model's name or a checkpoint folder's URI.")
@click.option("--workers", default=1, show_default=True, type=int)
@click.option("--gpus-per-worker", default=0, show_default=True, type=int)
@click.option("--expert-parallel-size", default=1, show_default=True, type=int)
@click.option("--rank", default=16, show_default=True, type=int, help="LoRA rank (alpha = 2 x rank).")
@click.option("--idle-timeout", default=900.0, show_default=True, help="Seconds without a call before it stops.")
@click.option("--wait/--no-wait", default=True, help="Wait until the group takes calls.")
@click.pass_obj
def sessions_create(obj: dict, model: str, workers: int, gpus_per_worker: int, expert_parallel_size: int,
                    rank: int, idle_timeout: float, wait: bool) -> None:
    """Start a session: a worker group holding a fresh LoRA on MODEL; prints its id once it takes calls."""
    session = _training(obj).create({
        "model": model, "idle_timeout_s": idle_timeout, "lora": {"rank": rank, "alpha": 2 * rank, "dropout": 0.0},
        "parallelism": {"num_workers": workers, "gpus_per_worker": gpus_per_worker,
                        "expert_parallel_size": expert_parallel_size}})
    _show(session.wait_ready(timeout=3600) if wait else session.info)


@sessions.command("list")
@click.option("--limit", default=20, show_default=True)
@click.pass_obj
def sessions_list(obj: dict, limit: int) -> None:
    """The newest sessions: id, status, model, restarts."""
    table = Table("id", "status", "model", "restarts", box=None, pad_edge=False)
    for s in _training(obj).list(limit).data:
        table.add_row(s.id, s.status + (f" ({s.close_reason})" if s.close_reason else ""), s.model, str(s.restarts))
    print_whole(console, table)


@sessions.command("get")
@click.argument("session_id")
@click.pass_obj
def sessions_get(obj: dict, session_id: str) -> None:
    """The session's status, model, where its states and weights go, and its restarts."""
    _show(_training(obj).session(session_id).info)


@sessions.command("close")
@click.argument("session_id")
@click.pass_obj
def sessions_close(obj: dict, session_id: str) -> None:
    """Stop the session's worker group; what it saved stays."""
    _show(_training(obj).session(session_id).close())


@sessions.command("restart")
@click.argument("session_id")
@click.option("--fresh", is_flag=True, help="Start a fresh LoRA instead of resuming the newest save_state.")
@click.pass_obj
def sessions_restart(obj: dict, session_id: str, fresh: bool) -> None:
    """A new worker group resuming from the newest save_state (a fresh LoRA before the first, or with --fresh)."""
    _show(_training(obj).session(session_id).restart(fresh=fresh))
