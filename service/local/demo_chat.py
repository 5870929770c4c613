"""The demo's last step: serve the just-trained adapter (the job's deploy call) and ask it, then its base, the same
question through the official openai SDK."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from moetune.api.client import Client
from moetune.api.models.responses import Job
from moetune.service.cli.serve import wait_until_running
from moetune.service.cluster import serve_deploy
from moetune.service.settings import Settings


def start_serving(settings: Settings, base: str) -> None:
    """Starts the Serve app for the demo's base while its job trains: the deploy call after the job then finds it
    up (same application config), so talking to the tuned model adds little time."""
    serve_deploy.deploy(settings.ray_address, settings.serve_url, settings.callback_url,
                        {base: settings.base_models[base]}, settings.s3_endpoint_url)


def first_question(data_file: Path) -> list[dict]:
    """The conversation of the file's first chat row up to its first assistant turn."""
    rows = (json.loads(line) for line in data_file.read_text().splitlines())
    messages = next(row["messages"] for row in rows if "messages" in row)
    upto = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:upto]


def chat_with_tuned_model(client: Client, job: Job, base: str, ray_address: str, token: str, data_file: Path,
                          console: Console) -> bool:
    """Prints the tuned model's and the base's greedy answers; False when the Serve app did not come up."""
    import openai

    started = time.monotonic()
    deployment = client.jobs.deploy(job.id)
    status = wait_until_running(ray_address, 180)
    if status != "RUNNING":
        console.print(f"[bold red]Serve app {status}[/]")
        return False
    console.print(f"[bold]Serving[/] {deployment.model} at {deployment.base_url} "
                  f"(up in {time.monotonic() - started:.0f}s)", soft_wrap=True)
    sdk = openai.OpenAI(base_url=deployment.base_url, api_key=token, max_retries=0)
    question = first_question(data_file)
    console.print(f"question: {question[-1]['content']!r}", markup=False, soft_wrap=True)
    for label, model in (("tuned", deployment.model), ("base", base)):
        answer = sdk.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0)
        console.print(f"chat {label} ({model}): {answer.choices[0].message.content!r}", markup=False,
                      soft_wrap=True)
    return True
