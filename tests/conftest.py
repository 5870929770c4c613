"""Shared real parts for the suite: one local S3 server and one local Ray head per session, and a
loopback receiver of worker reports."""

from __future__ import annotations

import os
import sys
import uuid

# One intra-op thread in every process the suite starts (this one, its Ray heads and workers, child processes): the
# tests' models are tiny, and the suite keeps both cores busy with several processes at once, where each torch
# process's second OpenMP thread spin-waits for a core. Measured on 2 cores beside three busy processes: an 8-step
# reference run took 14.2 s wall and 10.9 s CPU with 2 threads, 5.6 s and 2.8 s with 1. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import boto3  # noqa: E402 - after the thread count above
import pytest  # noqa: E402

from moetune.service.local.embedded import free_port, local_ray_head, local_s3_server, s3_env
from moetune.workers.settings import use_prebuilt_ops
from tests.support import REPO

# What the benchmarks run too (the EP harness, tiny models, quantized checkpoints, ...) is imported as bench.support:
# the repository root goes last on sys.path, so that an installed package named like one of its folders (the
# `kernels` that transformers loads hub kernels with) still wins.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from bench.support.receiver import ReportReceiver  # noqa: E402 - importable once the root is on sys.path

# Every process the suite starts (the Ray head and its workers, EP harness children) loads the DeepSpeed op that
# `make install` prebuilt into this virtualenv (with its ninja) instead of compiling it again.
use_prebuilt_ops()
# Ray Train's controller polls its worker group every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (default 2 s) while it
# starts the group, runs it and notices that it finished or lost a worker: each job paid several seconds of those
# waits. Set here, before the session's Ray head starts, so that every driver sees it: those run in this process
# (run_in_process), those the head's Jobs API starts (they inherit its environment), and `moetune demo`'s own head.
# Ray Train propagates it from a driver to its controller. A poll that times out is only a missed health check.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a real S3-compatible server (moto) on loopback; AWS_* and MOETUNE_S3_ENDPOINT_URL are set."""
    with local_s3_server() as url:
        env = s3_env(url)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        yield url
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket name on the session's S3 server."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def ray_head(s3_endpoint):
    """A real local Ray head (Jobs API at .dashboard_url, GCS at .gcs_address) that sees the S3 server."""
    with local_ray_head(num_cpus=4, env=s3_env(s3_endpoint)) as head:
        yield head


@pytest.fixture(scope="session")
def serve_url(ray_head) -> str:
    """Where Ray Serve listens on the session's Ray head: Serve keeps the HTTP port it first started with, so every
    control plane deploying on this head must name the same one."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def receiver():
    """A ReportReceiver on loopback for this test (bench.support.receiver)."""
    r = ReportReceiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup): while one waits (on a Ray job, a child
# process, a server) the other computes, and the jobs' own processes fill the cores (a full run on three workers kept
# 1.9 of 2 cores busy, and its third Ray head cost ~4 CPU-s a minute). Each worker is a pytest session of its own:
# one S3 server and, if it runs a job, one Ray head each. A module's tests run on one worker (their module fixtures
# are built once), and so do all tests sharing one of the expensive session fixtures below.
# The groups that run real jobs or share such a fixture are handed out first, the longest of them (measured in a
# full run) first of all, so that no long group starts last (LPT). `make test` passes --no-loadscope-reorder: xdist
# would otherwise hand out the groups with the most tests first, and the one-test job modules last.
_BUILT_ONCE = ("netns_stack", "ep_runs", "control_plane", "postgres_server", "checkpoints", "adapters")
_LONGEST = ("netns_stack", "ep_runs", "tests/service/test_local_stack.py",
            "tests/workers/checkpoints/test_resume_job.py", "control_plane", "tests/e2e/test_demo.py",
            "tests/e2e/test_console.py", "tests/kernels/test_compile_sm90.py", "tests/workers/loop/test_tuner_job.py",
            "tests/service/test_fuzz.py", "tests/kernels/test_gpu_check_dry_run.py",
            "tests/workers/reporting/test_job_metrics.py", "tests/workers/entry/test_driver.py",
            "tests/kernels/test_sparse_attention.py", "tests/workers/weights/test_quantized_job.py")


def pytest_collection_modifyitems(config, items):
    groups = {}
    for item in items:
        shared = next((name for name in _BUILT_ONCE if name in item.fixturenames), None)
        groups[item] = shared or item.nodeid.split("::")[0]
    long = {groups[item] for item in items if item.get_closest_marker("ray_job") or groups[item] in _BUILT_ONCE}

    def order(item) -> tuple[int, bool]:
        group = groups[item]
        return (_LONGEST.index(group) if group in _LONGEST else len(_LONGEST), group not in long)

    items.sort(key=order)  # stable: the order within a group is kept
    if getattr(config.option, "loadgroup", False):  # set on an xdist worker under --dist loadgroup
        for item in items:
            _with_group(item, groups[item])


def _with_group(item, group: str) -> None:
    """What xdist's own hook does with an `xdist_group` mark: the group after "@" in the node id, from which the
    controller schedules. xdist 3.8 writes it to `item._nodeid`, which pytest 9 no longer reads (its node ids live
    in `_id`), so under pytest 9 its loadgroup silently ran as plain load: module and session fixtures were built
    on every worker (ep_runs twice in a measured run)."""
    from _pytest.nodeid import coerce_node_id

    item._id = coerce_node_id(f"{item.nodeid}@{group}")
