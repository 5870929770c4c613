"""deploy/Dockerfile (no container engine here): hadolint, and the facts the chart and the README rely on."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

REPO_FILES = ("deploy/Dockerfile", "deploy/Dockerfile.dockerignore", "pyproject.toml", "setup.py", "README.md")


@pytest.fixture(scope="module")
def repo(chart_dir):
    root = chart_dir.parents[1]
    return {name: (root / name).read_text() for name in REPO_FILES}


def _instruction(dockerfile: str, name: str) -> str:
    """The argument of the last `name` instruction."""
    return re.findall(rf"^{name}\s+(.+)$", dockerfile, re.MULTILINE)[-1].strip()


def test_hadolint_finds_nothing(chart_dir):
    hadolint = os.path.join(os.path.dirname(sys.executable), "hadolint")
    result = subprocess.run([hadolint, "--no-color", str(chart_dir.parents[1] / "deploy" / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_starts_the_control_plane_like_the_readme_and_the_chart(repo, render):
    cmd = json.loads(_instruction(repo["deploy/Dockerfile"], "CMD"))
    assert cmd[:2] == ["moetune", "server"] and "moetune server" in repo["README.md"]
    container = render({}).control_plane
    assert container["command"] + container["args"] == cmd


def test_image_runs_as_a_numeric_non_root_user_matching_the_pod_security_context(repo, render):
    dockerfile = repo["deploy/Dockerfile"]
    user = _instruction(dockerfile, "USER")
    uid = re.search(r"^ARG UID=(\d+)$", dockerfile, re.MULTILINE).group(1) if user == "${UID}" else user
    assert uid.isdigit() and int(uid) != 0
    security = render({}).one("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] == int(uid)


def test_build_context_carries_every_package_setup_installs(repo):
    setup = ast.parse(repo["setup.py"])
    (folders,) = [ast.literal_eval(node.value) for node in setup.body
                  if isinstance(node, ast.Assign) and node.targets[0].id == "FOLDERS"]
    pyproject = tomllib.loads(repo["pyproject.toml"])
    allowed = {line[1:] for line in repo["deploy/Dockerfile.dockerignore"].splitlines() if line.startswith("!")}
    assert set(folders) | {"setup.py", "pyproject.toml", pyproject["project"]["readme"]} <= allowed


def test_each_image_variant_installs_its_extras(repo):
    """The CUDA image (Ray nodes) carries the `cuda` extra (fla's chunk_kda: without it the workers' KDA runs
    moetune's own Triton kernel); the CPU image never does (transformers would dispatch to fla on CPU)."""
    dockerfile = repo["deploy/Dockerfile"]
    stages = dict(re.findall(r"^FROM \S+ AS (base-\w+)\n(.*?)(?=^FROM )", dockerfile, re.MULTILINE | re.DOTALL))
    extras = {stage: set(re.search(r"MOETUNE_EXTRAS=(\S+)", body).group(1).split(","))
              for stage, body in stages.items()}
    assert extras == {"base-cpu": {"postgres"}, "base-cuda": {"postgres", "cuda"}}
    installs = [line for line in dockerfile.splitlines() if line.startswith("RUN pip install")]
    assert installs == ['RUN pip install "/tmp/moetune-src[${MOETUNE_EXTRAS}]" && rm -rf /tmp/moetune-src']
    declared = tomllib.loads(repo["pyproject.toml"])["project"]["optional-dependencies"]
    assert set().union(*extras.values()) <= declared.keys()
