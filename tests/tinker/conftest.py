"""The e2e tests' real stack (one `moetune server`, the session's Ray head and S3 server) for the Tinker tests, and
what tinker-cookbook's loops need beside it (tests/tinker/test_cookbook.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from bench.support.replicas import spawn_control_plane
from moetune.service.local.embedded import free_port, stop_process
from tests.e2e.conftest import control_plane, tiny_assets  # noqa: F401 - fixtures, shared with tests/e2e
from tests.support.control_plane import TOKENS, control_plane_env

# The cookbook hands one `model_name` to Tinker (base_model) and to AutoTokenizer: the tiny checkpoint is registered
# under a name that is also a hub repository's (a URI is no repository id), whose tokenizer a seeded cache holds.
COOKBOOK_MODEL = "tiny-kimi-linear"


@pytest.fixture(scope="module")
def cookbook(s3_endpoint, ray_head, tiny_assets, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """The environment a cookbook loop runs in, as a user's would: a control plane with the tiny checkpoint
    registered as COOKBOOK_MODEL, the two Tinker variables pointing at it, and the tokenizer in a Hugging Face cache
    read offline. Every other address goes to a closed port: a loop that reaches for the network fails."""
    work = tmp_path_factory.mktemp("cookbook")
    snapshot = work / "hub" / f"models--{COOKBOOK_MODEL}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    for path in tiny_assets["local_model"].iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, snapshot)
    port = free_port()
    env = {**control_plane_env(s3_endpoint, ray_head, work, port),
           "MOETUNE_BASE_MODELS": json.dumps({COOKBOOK_MODEL: tiny_assets["model"]}),
           "MOETUNE_RESTORE_DEPLOYMENTS": "false"}  # the Ray head's Serve app is the other control plane's
    proc = spawn_control_plane(env, port, work / "server.log")
    closed = f"http://127.0.0.1:{free_port()}"
    try:
        yield {"model": COOKBOOK_MODEL, "server_log": work / "server.log",
               "env": {**os.environ, "TINKER_BASE_URL": f"http://127.0.0.1:{port}/tinker",
                       "TINKER_API_KEY": "tml-" + TOKENS["tenant-a"], "HF_HUB_OFFLINE": "1",
                       "HF_HUB_CACHE": str(work / "hub"),
                       **{name: closed for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")},
                       "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}}
    finally:
        stop_process(proc)
