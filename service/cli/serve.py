"""`moetune serve`, `moetune chat`, `moetune jobs deploy` and `moetune models download`: from a tuned model's name
to answers (the Serve app through the official openai SDK) or to the adapter's files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.console import Console

from moetune.api import storage
from moetune.api.client import Client
from moetune.service.api_exception import APIException
from moetune.service.cluster import serve_deploy

console = Console()
# without a `moetune up` stack in this directory (whose own addresses the CLI hands to these commands at run time)
_SERVE_URL = "http://127.0.0.1:8001"
_RAY_ADDRESS = "http://127.0.0.1:8265"
_FROM_STACK = "[default: the `moetune up` stack's of this directory, else {}]"


def _ray_address_option(help: str):
    return click.option("--ray-address", envvar="MOETUNE_RAY_ADDRESS", default=None,
                        help=f"{help} {_FROM_STACK.format(_RAY_ADDRESS)}")


def _client(ctx: click.Context) -> Client:
    return Client(ctx.obj["url"], ctx.obj["token"])


def _wait(ray_address: str, timeout: float) -> dict:
    """Polls the Serve app until its replicas are up or failed; returns its last state (serve_deploy.current_app)."""
    deadline = time.monotonic() + timeout
    while True:
        app = serve_deploy.current_app(ray_address) or {"status": "NOT_STARTED", "message": ""}
        if app["status"] in ("RUNNING", "DEPLOY_FAILED") or time.monotonic() > deadline:
            return app
        time.sleep(1)


def wait_until_running(ray_address: str, timeout: float) -> str:
    """Polls the Serve app until its replicas are up; returns its last status."""
    return _wait(ray_address, timeout)["status"]


def _require_running(ray_address: str, timeout: float) -> str:
    """Waits for the Serve app's replicas; a clear error (exit 1) with Ray's cause unless it runs."""
    app = _wait(ray_address, timeout)
    if app["status"] != "RUNNING":
        cause = app["message"] or "see the Ray dashboard's Serve page"
        raise click.ClickException(f"the Serve app is {app['status']}: {cause}")
    return app["status"]


def print_openai_snippet(base_url: str, model: str) -> None:
    # soft_wrap: lines longer than the terminal are left to it to fold, so that copying gives the line back whole
    console.print(f"[bold]OpenAI base URL[/] {base_url}\n"
                  f"  client = openai.OpenAI(base_url={base_url!r}, api_key=<your moetune token>)\n"
                  f"  client.chat.completions.create(model={model!r}, messages=[...])", soft_wrap=True,
                  highlight=False)


@click.command()
@click.argument("models", nargs=-1)
@_ray_address_option("The Ray dashboard (Jobs and Serve REST API).")
@click.option("--serve-url", envvar="MOETUNE_SERVE_URL", default=None,
              help="Where clients reach the Serve HTTP proxy (it listens on this port). "
                   + _FROM_STACK.format(_SERVE_URL))
@click.option("--control-plane", "control_plane", default=None,
              help="The control plane as the Serve replicas reach it (default: --url).")
@click.option("--s3-endpoint-url", envvar="MOETUNE_S3_ENDPOINT_URL", default=None)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the replicas.")
@click.pass_context
def serve(ctx: click.Context, models: tuple[str, ...], ray_address: str | None, serve_url: str | None,
          control_plane: str | None, s3_endpoint_url: str | None, timeout: float) -> None:
    """Runs the OpenAI-compatible Serve app on the Ray cluster for the bases of MODELS (names of bases or tuned
    models; none: every registered base) and prints its base URL."""
    ray_address, serve_url = ray_address or _RAY_ADDRESS, serve_url or _SERVE_URL
    client = _client(ctx)
    names = models or tuple(m.id for m in client.models.list().data if not m.id.startswith("ft:"))
    if not names:
        raise click.ClickException("no model to serve: name one, or register bases (MOETUNE_BASE_MODELS)")
    bases = {}
    for name in names:
        served = client.models.retrieve(name).moetune
        bases[served.base_model] = served.base_model_uri
    try:
        serve_deploy.deploy(ray_address, serve_url, control_plane or ctx.obj["url"], bases, s3_endpoint_url)
    except APIException as e:  # Ray unreachable, or the same config already failed (with Ray's cause)
        raise click.ClickException(e.message) from None
    console.print(f"Serving {', '.join(sorted(bases))} on {ray_address}")
    _require_running(ray_address, timeout)
    print_openai_snippet(serve_deploy.openai_base_url(serve_url), names[0])


@click.command("deploy")
@click.argument("job_id")
@click.option("--wait/--no-wait", default=True, help="Wait until the replicas answer.")
@_ray_address_option("The Ray dashboard, asked whether the replicas run.")
@click.pass_context
def deploy(ctx: click.Context, job_id: str, wait: bool, ray_address: str | None) -> None:
    """Serves a succeeded job's model through the control plane (POST .../jobs/{id}/deploy)."""
    deployment = _client(ctx).jobs.deploy(job_id)
    console.print(f"{deployment.model}: {deployment.status}", soft_wrap=True, highlight=False)
    if wait and deployment.status != "RUNNING":
        console.print(f"Serve app: {_require_running(ray_address or _RAY_ADDRESS, 600)}")
    print_openai_snippet(deployment.base_url, deployment.model)


@click.command()
@click.argument("model")
@click.argument("local_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--s3-endpoint-url", envvar="MOETUNE_S3_ENDPOINT_URL", default=None)
@click.pass_context
def download(ctx: click.Context, model: str, local_dir: Path, s3_endpoint_url: str | None) -> None:
    """Copies a tuned model's adapter (adapter_config.json + weights) to LOCAL_DIR, its config naming the base by
    URI (base_model_name_or_path), ready for PeftModel.from_pretrained or vLLM."""
    served = _client(ctx).models.retrieve(model).moetune
    if served.adapter_uri is None:
        raise click.ClickException(f"{model} is a base model: there is no adapter to download ({served.base_model_uri})")
    storage.download_dir(served.adapter_uri, str(local_dir), endpoint_url=s3_endpoint_url)
    config_path = local_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = served.base_model_uri  # adapters exported before it was set have null
    config_path.write_text(json.dumps(config, indent=2))
    console.print(f"{model} -> {local_dir}/ (base {served.base_model_uri})")


@click.command()
@click.argument("model")
@click.option("--base-url", envvar="MOETUNE_SERVE_URL", default=None,
              help="The Serve app (its /v1 is added). " + _FROM_STACK.format(_SERVE_URL))
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 2),
              help="0 answers greedily (the same answer every time), as the console's playground does.")
@click.pass_context
def chat(ctx: click.Context, model: str, base_url: str | None, max_tokens: int, temperature: float) -> None:
    """Talks to MODEL interactively, answers streamed token by token (empty line or Ctrl-D ends).

    What to expect: the demo's tiny model (random weights, then 30 steps of tuning) knows no language: it answers
    with fragments of its training rows at best, and at a higher temperature with noise, control bytes included.
    A real base tuned on real data answers as that base does.
    """
    import openai

    base_url = base_url or _SERVE_URL
    client = openai.OpenAI(base_url=serve_deploy.openai_base_url(base_url.removesuffix("/v1")),
                           api_key=ctx.obj["token"])
    history: list[dict] = []
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        try:
            stream = client.chat.completions.create(model=model, messages=history, max_tokens=max_tokens,
                                                    temperature=temperature, stream=True)
            answer = []
            console.print(f"{model}> ", end="")
            for chunk in stream:
                delta = chunk.choices[0].delta.content if chunk.choices else None
                if delta:
                    answer.append(delta)
                    console.print(delta, end="", markup=False, highlight=False)
            console.print()
        except openai.APIStatusError as e:
            raise click.ClickException(f"{e.status_code}: {e.message}") from None
        except openai.APIConnectionError:  # nothing listens there: no model deployed, or another URL
            raise click.ClickException(f"cannot reach the Serve app at {client.base_url} (`moetune jobs deploy ID` "
                                       "starts it; --base-url or MOETUNE_SERVE_URL says where it is)") from None
        history.append({"role": "assistant", "content": "".join(answer)})
