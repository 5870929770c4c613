"""bench/gpu_check.py, the prepared one-GPU check, runs as it is on a bare GPU image given its own install list:
bench/gpu_check_requirements.txt resolves with torch and Triton (every requirement of every listed package, and
of torch and Triton, is met by a listed pin or by torch's own requirements), and the --dry-run takes every stage's
code path on this CPU (Triton through the interpreter, gloo, tiny shapes) in a virtualenv that holds torch, Triton
and that list alone, moetune imported from the checkout as on a GPU host. It prints the stage plan first (budgets
totalling at most 8 minutes), writes each stage's JSON line to $OUT and ends with a RESULT line that reports no
failed stage."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import venv

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import REPO

REQUIREMENTS = REPO / "bench" / "gpu_check_requirements.txt"
GPU_IMAGE = ("torch", "triton")  # what a GPU image brings, with what they require themselves


def _pins(gpu_only: bool = True) -> dict[str, str]:
    """name -> pinned version of the requirements file (its `# gpu only` lines only when asked for)."""
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        spec = line.split("#")[0].strip()
        if spec and (gpu_only or "# gpu only" not in line):
            name, version = re.fullmatch(r"([\w.-]+)==([\w.]+)", spec).groups()
            pins[canonicalize_name(name)] = version
    return pins


def _requirements(dist) -> list[Requirement]:
    """dist's unconditional requirements on this platform (extras left out)."""
    reqs = [Requirement(r) for r in dist.requires or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _with_requirements(names) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions `names` and everything they require, by canonical name."""
    found, todo = {}, [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name not in found:
            found[name] = importlib.metadata.distribution(name)
            todo += [canonicalize_name(r.name) for r in _requirements(found[name])]
    return found


def test_requirements_resolve_with_torch_and_triton_alone():
    """The list is closed under requirements (pip install --no-deps of it leaves nothing missing) and pins what
    the suite runs, so the dry run below tests exactly these versions."""
    pins, cpu_pins = _pins(), _pins(gpu_only=False)
    image = _with_requirements(GPU_IMAGE)
    versions = {name: d.version for name, d in image.items()} | pins
    dists = image | {name: importlib.metadata.distribution(name) for name in cpu_pins}
    assert {n: importlib.metadata.version(n) for n in cpu_pins} == cpu_pins
    unmet = [f"{name} needs {req}" for name, dist in dists.items() for req in _requirements(dist)
             if canonicalize_name(req.name) not in versions
             or not req.specifier.contains(versions[canonicalize_name(req.name)], prereleases=True)]
    assert not unmet, unmet


def _link_distributions(dists, site) -> None:
    """`site` holds exactly the files these installed distributions recorded (linked, not copied)."""
    for dist in dists:
        for file in dist.files or ():
            source = dist.locate_file(file)
            if file.parts[0] == ".." or not source.exists():  # scripts outside site-packages, uncompiled caches
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                os.symlink(source, target)


def test_gpu_check_dry_run_passes_every_stage_in_a_venv_of_its_list(tmp_path):
    venv.create(tmp_path / "venv", with_pip=False)
    site = next((tmp_path / "venv" / "lib").glob("python*/site-packages"))
    _link_distributions(_with_requirements([*GPU_IMAGE, *_pins(gpu_only=False)]).values(), site)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH", "VIRTUAL_ENV")}
    out = tmp_path / "out"
    out.mkdir()
    env |= {"OUT": str(out), "HF_HUB_OFFLINE": "1"}
    python = tmp_path / "venv" / "bin" / "python"
    isolated = subprocess.run([python, "-c", "import sys, importlib.util; print(sys.prefix != sys.base_prefix, "
                               "importlib.util.find_spec('moetune'), importlib.util.find_spec('ray'))"],
                              env=env, capture_output=True, text=True, check=True)
    assert isolated.stdout.split() == ["True", "None", "None"], isolated  # neither moetune nor the rest installed
    done = subprocess.run([python, str(REPO / "bench" / "gpu_check.py"), "--dry-run"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    stages = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages] == ["plan", "env", "correctness", "syncs", "job_step", "builder_step",
                                             "images_zero3", "ep2_export", "context_parallel", "sparse_dkv",
                                             "bench"]
    assert not any("error" in s for s in stages), stages
    plan, by_stage = stages[0], {s["stage"]: s for s in stages}
    assert list(plan["budget_seconds"]) == [s["stage"] for s in stages[1:]]
    assert plan["total_seconds"] == sum(plan["budget_seconds"].values()) <= 8 * 60
    assert by_stage["correctness"]["rmse_ratio"] and by_stage["job_step"]["losses"]
    assert 0 <= by_stage["context_parallel"]["moetune"]["rmse"] <= by_stage["context_parallel"]["tolerance"]
    cases = [row for row in by_stage["sparse_dkv"].values() if isinstance(row, dict)]
    assert cases and {row["chosen"] for row in cases} <= {"key_major", "query_major"}
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT failed=none "), result
