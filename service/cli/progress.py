"""Following a job from the terminal: a rich progress bar with step, loss and ETA, plus its messages."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from moetune.api.client import Client
from moetune.api.models.responses import Job, JobEvent

_LEVEL_STYLE = {"info": "", "warn": "yellow", "error": "bold red"}


class JobFollower:
    """Renders a job's event stream; remembers the losses it saw (first/last for summaries)."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self.losses: list[float] = []
        self._progress = Progress(
            TextColumn("[bold]step {task.completed:.0f}/{task.total:.0f}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = None

    def on_event(self, event: JobEvent) -> None:
        if event.type == "metrics" and event.data:
            self._on_metrics(event.data)
        else:
            style = _LEVEL_STYLE.get(event.level, "")
            self._progress.console.print(f"[{style}]{event.message}" if style else event.message, markup=bool(style))

    def _on_metrics(self, data: dict) -> None:
        step, total = data.get("step"), data.get("total_steps")
        loss = data.get("train_loss")
        if loss is not None:
            self.losses.append(loss)
        if step is None:
            return
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task("train", total=total or step, loss="-")
        shown = f"{loss:.4f}" if loss is not None else "-"
        if data.get("valid_loss") is not None:
            shown += f" (valid {data['valid_loss']:.4f})"
        self._progress.update(self._task, completed=step, total=total or step, loss=shown)

    def close(self) -> None:
        if self._task is not None:
            self._progress.stop()


def follow(client: Client, job_id: str, timeout: float, console: Console | None = None) -> tuple[Job, JobFollower]:
    """Blocks until the job ends (or `timeout` seconds pass), rendering progress on the way."""
    follower = JobFollower(console)
    try:
        job = client.jobs.wait(job_id, timeout=timeout, on_event=follower.on_event)
    finally:
        follower.close()
    return job, follower
