"""`moetune up` / `moetune down`: the S3 server and the control plane as background processes (here on the
session's Ray head), their data kept across a restart, and the CLI finding the stack of the directory."""

from __future__ import annotations

import os

import boto3
import httpx
from click.testing import CliRunner

from moetune.api.client import Client
from moetune.service.cli import main as cli
from moetune.service.local import processes
from moetune.service.local import stack as local_stack
from moetune.service.local.embedded import s3_env


def _run(*args):
    result = CliRunner().invoke(cli.main, list(args), catch_exceptions=False, env={"MOETUNE_URL": None,
                                                                                   "MOETUNE_TOKEN": None})
    assert result.exit_code == 0, result.output
    return result.output


def test_up_prints_how_to_reach_it_keeps_data_across_down_and_up(ray_head, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the stack of this directory: .moetune/
    for name in [*s3_env(""), "MOETUNE_RAY_ADDRESS"]:  # `up` and the CLI set them here: the session's come back
        monkeypatch.delenv(name, raising=False)
    output = _run("up", "--ray-address", ray_head.dashboard_url)
    stack = local_stack.read_stack()
    assert f"control plane {stack.url} (token {stack.token})" in output
    assert f"export MOETUNE_URL={stack.url}" in output and f"export MOETUNE_TOKEN={stack.token}" in output
    assert f"export MOETUNE_S3_ENDPOINT_URL={stack.s3_endpoint}" in output
    assert f"export MOETUNE_RAY_ADDRESS={ray_head.dashboard_url}" in output
    try:
        uploaded = Client(stack.url, stack.token).files.create(b'{"text": "kept"}\n', "kept.jsonl")
        s3 = boto3.client("s3", endpoint_url=stack.s3_endpoint)
        s3.put_object(Bucket="moetune", Key="outputs/", Body=b"")  # a folder marker, as Ray Train writes them
        s3.put_object(Bucket="moetune", Key="outputs/run/adapter.bin", Body=b"weights")
        for name in s3_env(""):
            monkeypatch.delenv(name)
        assert _run("jobs", "list").split() == ["id", "status", "step", "loss", "created", "model"]  # found it
        # and handed its Ray address and S3 credentials to the command (jobs deploy, serve, models download)
        handed = {name: value for name, value in stack.env().items() if name not in ("MOETUNE_URL", "MOETUNE_TOKEN")}
        assert {name: os.environ.get(name) for name in handed} == handed
        reply = httpx.post(f"{stack.url}/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {stack.token}"},
                           json={"model": "s3://moetune/models/x", "training_file": "file:///etc/passwd"})
        assert (reply.status_code, reply.json()["error"]["param"]) == (422, "training_file")  # file:// is off
        assert _run("down") == "down; data kept in .moetune\n"
        assert not local_stack.read_stack() and not any(processes.alive(p) for p in stack.pids.values())

        _run("up", "--ray-address", ray_head.dashboard_url)
        again = local_stack.read_stack()
        assert (again.url, again.token) == (stack.url, stack.token)  # same address and token
        assert Client(again.url, again.token).files.content(uploaded.id) == b'{"text": "kept"}\n'
        s3 = boto3.client("s3", endpoint_url=again.s3_endpoint)
        assert s3.get_object(Bucket="moetune", Key="outputs/run/adapter.bin")["Body"].read() == b"weights"
    finally:
        _run("down")
    assert _run("down") == "nothing was up\n"
