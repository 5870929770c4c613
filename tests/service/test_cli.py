"""The `moetune` command's rough edges, through click's runner against a real control plane and S3 server."""

from __future__ import annotations

import importlib.metadata
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import click
import pytest
from click.testing import CliRunner
from rich.console import Console

from moetune.api.families import FAMILIES
from moetune.service.cli import main as cli
from moetune.service.cli import sessions as cli_sessions
from moetune.service.local.embedded import free_port, s3_env
from moetune.workers.families import REGISTRY
from bench.support.tiny_models import plain_model


def _run(*args, env: dict | None = None):
    return CliRunner().invoke(cli.main, list(args), env=env, catch_exceptions=False)


def test_an_unreachable_server_is_one_line_without_a_traceback():
    url = f"http://127.0.0.1:{free_port()}"
    result = _run("--url", url, "jobs", "list")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"Error: cannot reach the control plane at {url}: "
                                                  "[Errno 111] Connection refused"]


def test_chat_with_no_serve_app_listening_is_one_line_without_a_traceback():
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(cli.main, ["--url", url, "chat", "ft:any", "--base-url", url], input="hi\n",
                                catch_exceptions=False)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"you> Error: cannot reach the Serve app at {url}/v1/ (`moetune "
                                                  "jobs deploy ID` starts it; --base-url or MOETUNE_SERVE_URL says "
                                                  "where it is)"]  # the prompt, then the one line


def test_jobs_list_is_readable_at_80_columns(service, monkeypatch):
    jobs = [service.create_job(model="s3://models/a-rather-long-base-model-name-for-the-table") for _ in range(2)]
    monkeypatch.setattr(cli, "console", Console(width=80))
    result = _run("--url", service.url, "--token", "tok-a", "jobs", "list", "--limit", "2")
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    for job in jobs:
        (row,) = [line for line in lines if job["id"] in line]
        assert "validating_files" in row and "0/?" in row and "a-rather" in row


def test_data_upload_goes_through_the_files_api(service, tmp_path):
    good, bad = tmp_path / "train.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"text": "one"}\n{"text": "two"}\n')
    bad.write_text('{"text": "one"}\n{"txt": "two"}\n')
    result = _run("--url", service.url, "--token", "tok-a", "data", "upload", str(good))
    file_id = result.output.split()[0]
    assert result.exit_code == 0 and result.output.strip().endswith("train.jsonl (2 rows, 32 bytes)")
    assert service.sdk().files.content(file_id) == good.read_bytes()

    refused = _run("--url", service.url, "--token", "tok-a", "data", "upload", str(bad))
    assert refused.exit_code == 1 and refused.output.strip() == (
        "Error: 422 invalid_request (file): file: bad.jsonl row 2: must have exactly one of 'text' or 'messages'")


def test_models_push_to_a_missing_bucket_names_it_and_make_bucket_creates_it(s3_endpoint, tmp_path):
    env = s3_env(s3_endpoint)
    missing = _run("models", "push", str(tmp_path), "s3://no-bucket-yet-7/models/m", env=env)
    assert missing.exit_code == 1 and missing.output.strip() == (
        "Error: s3://no-bucket-yet-7/models/m: the bucket 'no-bucket-yet-7' does not exist (create it with "
        "`moetune data make-bucket s3://no-bucket-yet-7`)")
    made = _run("data", "make-bucket", "s3://no-bucket-yet-7", env=env)
    assert made.exit_code == 0, made.output
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    assert "no-bucket-yet-7" in [b["Name"] for b in s3.list_buckets()["Buckets"]]


@pytest.mark.parametrize("path", ["/v1/fine_tuning/jobs/", "/v1/files/"])
def test_a_trailing_slash_answers_like_the_path_without_it(service, path):
    response = service.http().get(path)
    assert response.status_code == 200 and response.json()["object"] == "list"


@pytest.mark.parametrize("args", [["jobs", "list", "--help"], ["submit", "--help"], ["jobs", "deploy", "--help"]])
def test_client_commands_import_no_server(args):
    """A command that only talks to the control plane is an SDK client: it loads neither FastAPI nor SQLAlchemy
    (the server's stack), only `moetune server`, `up` and `demo` do."""
    code = ("import sys\nfrom moetune.service.cli.main import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'sqlalchemy', 'uvicorn'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint as transformers saves it."""
    path = tmp_path_factory.mktemp("deepseek")
    plain_model(REGISTRY["deepseek_v3"]).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": "fp8"}, "config.json field 'quantization_config' must be an object, not a string 'fp8'"),
    ({"quantization_config": {"fmt": "e4m3", "weight_block_size": [128, 128]}},
     "config.json field 'quantization_config.quant_method' is missing; supported: fp8 (block scales), "
     "compressed-tensors ("),
    ({"n_routed_experts": "8"}, "config.json field 'n_routed_experts' must be an integer, not a string '8'"),
    ({"model_type": "mythical_moe"},
     f"model_type 'mythical_moe' is not supported; supported: {', '.join(sorted(FAMILIES))}"),
])
def test_models_inspect_answers_a_malformed_or_unsupported_config_in_one_line(deepseek_dir, tmp_path, change,
                                                                                message):
    """The same answers as submission's 422 (tests/service/test_ep_submission.py), not a traceback or transformers'
    own "Unrecognized model identifier"."""
    model = tmp_path / "model"
    shutil.copytree(deepseek_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    result = _run("models", "inspect", f"file://{model}")
    assert result.exit_code == 1 and result.output.strip().startswith(f"Error: file://{model}: {message}")
    assert len(result.output.strip().splitlines()) == 1


def test_version_is_the_installed_packages():
    assert _run("--version").output == f"moetune, version {importlib.metadata.version('moetune')}\n"


def _commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


def test_every_command_says_what_it_does():
    """`moetune jobs --help` listed cancel, events, get and list with an empty description."""
    assert [" ".join(path) for path, command in _commands(cli.main) if not (command.help or "").strip()] == []


@pytest.mark.parametrize("args, fallback", [(["chat", "--help"], "http://127.0.0.1:8001"),
                                            (["jobs", "deploy", "--help"], "http://127.0.0.1:8265"),
                                            (["serve", "--help"], "http://127.0.0.1:8001")])
def test_help_shows_no_default_that_the_stack_overrides(args, fallback):
    """The stack of the directory hands its Ray address and Serve URL to these commands at run time: the help says
    so instead of showing a default that is not the one used."""
    output = " ".join(_run(*args).output.split())
    assert f"[default: {fallback}]" not in output
    assert f"[default: the `moetune up` stack's of this directory, else {fallback}]" in output


def test_chat_defaults_to_temperature_0_as_the_playground_and_says_what_a_tiny_model_answers():
    playground = (Path(cli.__file__).parents[1] / "console/static/playground.js").read_text()
    assert re.search(r'id: "temperature", value: 0\b', playground)
    assert {option.name: option.default for option in cli.serve_commands.chat.params}["temperature"] == 0
    assert "30 steps of tuning" in " ".join(_run("chat", "--help").output.split())


def test_the_deploy_snippet_copies_back_whole_at_80_columns(monkeypatch):
    """At 80 columns rich broke the snippet inside the model's name: lines are left to the terminal to fold."""
    out = io.StringIO()
    monkeypatch.setattr(cli.serve_commands, "console", Console(width=80, file=out))
    model = "ft:a-rather-long-base-model-name-for-a-snippet:local:ftjob-0123456789abcdef0123"
    cli.serve_commands.print_openai_snippet("http://127.0.0.1:23456/v1", model)
    lines = out.getvalue().splitlines()
    assert f"  client.chat.completions.create(model={model!r}, messages=[...])" in lines
    assert "  client = openai.OpenAI(base_url='http://127.0.0.1:23456/v1', api_key=<your moetune token>)" in lines


def test_sessions_list_prints_whole_ids_at_80_columns(start_service, monkeypatch):
    service = start_service(ray_address=f"http://127.0.0.1:{free_port()}")  # nothing there: the session fails
    model = "s3://a-bucket-with-a-long-name/models/a-rather-long-base-model-name-for-the-table"
    with service.http() as http:
        http.post("/v1/training_sessions", json={"model": model, "lora": {"rank": 4}})
        (session,) = http.get("/v1/training_sessions").json()["data"]
    monkeypatch.setattr(cli_sessions, "console", Console(width=80))
    listed = _run("--url", service.url, "--token", "tok-a", "sessions", "list").output
    (row,) = [line for line in listed.splitlines() if session["id"] in line]
    assert row.split()[0] == session["id"] and row.split()[-2:] == [model, "0"]  # one line, nothing cut


def test_an_unknown_field_in_a_job_file_gets_a_did_you_mean(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("model: tiny-kimi-k3\ntraining_file: s3://b/train.jsonl\nsufix: x\nlora: {rnak: 8}\n"
                    "training: {max_step: 3}\n")
    result = _run("submit", str(spec))  # refused before any control plane is asked
    first, *problems = result.output.splitlines()
    assert result.exit_code == 1 and first == f"Error: {spec}:"
    assert sorted(problems) == ["  lora.rnak: unknown field; did you mean lora.rank?",
                                "  sufix: unknown field; did you mean suffix?",
                                "  training.max_step: unknown field; did you mean training.max_steps?"]
