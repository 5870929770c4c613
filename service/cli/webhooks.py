"""`moetune webhooks create|list|get|delete`: the tenant's webhook endpoints (POST /v1/webhook_endpoints)."""

from __future__ import annotations

from datetime import UTC, datetime

import click
from rich.console import Console
from rich.table import Table

from moetune.api.client import Client
from moetune.api.models.webhooks import WEBHOOK_EVENT_TYPES
from moetune.service.cli.output import print_whole

console = Console()


def _client(obj: dict) -> Client:
    return Client(obj["url"], obj["token"])


@click.group()
def webhooks() -> None:
    """Endpoints that job events are POSTed to (signed the Standard Webhooks way, as OpenAI signs them)."""


@webhooks.command("create")
@click.argument("url")
@click.option("--event", "events", multiple=True, type=click.Choice(WEBHOOK_EVENT_TYPES),
              help="An event type to send (repeatable) [default: all].")
@click.option("--name", default=None, help="[default: the URL's host]")
@click.pass_obj
def webhooks_create(obj: dict, url: str, events: tuple[str, ...], name: str | None) -> None:
    """Register URL; prints the signing secret, which is shown this once."""
    endpoint = _client(obj).webhooks.create(url, list(events) or None, name)
    console.print(f"created [bold]{endpoint.id}[/] for {endpoint.url} ({', '.join(endpoint.event_types)})",
                  highlight=False)
    console.print(f"signing secret (shown once): {endpoint.signing_secret}", markup=False, highlight=False)


@webhooks.command("list")
@click.pass_obj
def webhooks_list(obj: dict) -> None:
    """Every endpoint of the tenant: id, name, URL, event types, when created."""
    client, after = _client(obj), None
    table = Table("id", "name", "url", "events", "created", box=None, pad_edge=False)
    while True:
        page = client.webhooks.list(after=after, limit=100)
        for e in page.data:
            table.add_row(e.id, e.name, e.url, ",".join(t.removeprefix("fine_tuning.job.") for t in e.event_types),
                          datetime.fromtimestamp(e.created_at, UTC).strftime("%m-%d %H:%M"))
        if not page.has_more:
            break
        after = page.last_id
    print_whole(console, table)


@webhooks.command("get")
@click.argument("endpoint_id")
@click.pass_obj
def webhooks_get(obj: dict, endpoint_id: str) -> None:
    """The endpoint as JSON (the signing secret only as a hint: it was shown once, by create)."""
    console.print_json(_client(obj).webhooks.retrieve(endpoint_id).model_dump_json())


@webhooks.command("delete")
@click.argument("endpoint_id")
@click.pass_obj
def webhooks_delete(obj: dict, endpoint_id: str) -> None:
    """Stop sending to it; its undelivered events are dropped."""
    _client(obj).webhooks.delete(endpoint_id)
    console.print(f"deleted {endpoint_id}")
