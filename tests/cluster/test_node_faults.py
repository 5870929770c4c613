"""On the multi-node cluster (tests/cluster/conftest.py): one tiny EP=2 job whose two workers sit on the two worker
nodes (its expert-parallel group crosses the node boundary) runs once uninterrupted, then once through a worker
node killed mid-step (every process of its namespace) and then a worker node cut off (its link down, its
processes alive); the second run resumes from its newest complete checkpoint each time and ends with the
reference's losses, step for step."""

from __future__ import annotations

import json
import os
import sys
import time

import httpx
import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from bench.support.netns_cluster import DETECTION_BOUND_S, NIC
from moetune.api.models.job_create import JobCreate
from moetune.api.models.job_run import JobRunSpec
from tests.support.jobs import driver_env
from tests.support.receiver import ReportReceiver

pytestmark = pytest.mark.ray_job
STEPS, CHECKPOINT_EVERY, KILL_AFTER, CUT_AFTER = 8, 2, 3, 6
JOB_TIMEOUT_S = 600


def _run_spec(stack, job_id: str) -> JobRunSpec:
    spec = JobCreate(model=f"{stack.assets}/models/tiny", training_file=f"{stack.assets}/data/train.jsonl",
                     validation_file=f"{stack.assets}/data/valid.jsonl",
                     lora={"rank": 4, "alpha": 8, "train_experts": True},
                     training={"max_steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "learning_rate": 3e-3,
                               "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64},
                     parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2})
    return JobRunSpec(job_id=job_id, spec=spec, seed=5, output_uri=f"{stack.assets}/out/{job_id}")


def _submit(stack, run: JobRunSpec, receiver: ReportReceiver) -> tuple[JobSubmissionClient, str]:
    """The driver as the control plane starts it: a Ray job through the head's Jobs API."""
    jobs = JobSubmissionClient(stack.cluster.dashboard_url)
    sid = jobs.submit_job(entrypoint=f"{sys.executable} -m moetune.workers.entry.driver",
                          runtime_env={"env_vars": driver_env(run, receiver)})
    return jobs, sid


def _wait(what: str, predicate, timeout: float, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)
    return value


def _ended(jobs: JobSubmissionClient, sid: str) -> JobStatus | None:
    status = jobs.get_job_status(sid)
    return status if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED) else None


def _history(stack, run: JobRunSpec) -> list[dict]:
    key = f"{run.output_uri.removeprefix(f'{stack.assets}/')}/metrics.jsonl"
    body = stack.s3().get_object(Bucket=stack.assets.removeprefix("s3://"), Key=key)["Body"].read().decode()
    return [json.loads(line) for line in body.splitlines()]


def _messages(receiver: ReportReceiver, prefix: str) -> list:
    return [e for e in receiver.of_kind("event") if e.type == "message" and e.message.startswith(prefix)]


def _node_series(address: str) -> str | None:
    """A worker node's exporter page, once it carries the node's series."""
    try:
        text = httpx.get(f"http://{address}:9470/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    return text if "moetune_node_network_sent_bytes_total{" in text else None


def _cache_bytes(node) -> int:
    folder = os.path.join(node.temp_dir, "moetune", "weights-cache")
    return sum(os.path.getsize(os.path.join(parent, name)) for parent, _, names in os.walk(folder)
               for name in names if not name.startswith("."))


@pytest.fixture(scope="module")
def reference(netns_stack):
    """The uninterrupted run: its history, and each worker node's exporter page seen while it ran."""
    receiver = ReportReceiver(host=netns_stack.cluster.host_address)
    run = _run_spec(netns_stack, "ftjob-reference")
    jobs, sid = _submit(netns_stack, run, receiver)
    pages = {}
    try:
        def done():
            for node in netns_stack.cluster.workers:
                if node.address not in pages and (page := _node_series(node.address)):
                    pages[node.address] = page
            return _ended(jobs, sid)

        status = _wait("the reference job", done, JOB_TIMEOUT_S, poll=0.5)
        assert status == JobStatus.SUCCEEDED, jobs.get_job_logs(sid)[-3000:]
    finally:
        receiver.server.shutdown()
    return {"history": _history(netns_stack, run), "pages": pages, "receiver": receiver}


def test_a_job_spreads_over_nodes_with_node_caches_and_node_metrics(netns_stack, reference):
    cluster = netns_stack.cluster
    (result,) = reference["receiver"].of_kind("result")
    assert result.status == "succeeded", result.error
    assert [r["step"] for r in reference["history"]] == list(range(1, STEPS + 1))
    # Each worker node served its own node series: its hostname, its address, its NIC's bytes (not loopback's).
    assert sorted(reference["pages"]) == sorted(n.address for n in cluster.workers)
    for node in cluster.workers:
        page = reference["pages"][node.address]
        labels = f'address="{node.address}",device="{NIC}",job_id="ftjob-reference",node="{node.name}"'
        sent = next(line for line in page.splitlines() if line.startswith("moetune_node_network_sent_bytes_total{")
                    and labels in line)
        assert float(sent.rsplit(" ", 1)[1]) > 0
    # Each worker node streamed its rank's share into its own node-local cache; the head (no workers) none.
    cached = {node.name: _cache_bytes(node) for node in cluster.nodes}
    assert cached["head"] == 0 and all(cached[n.name] > 0 for n in cluster.workers), cached
    print(f"node caches: {cached}")


def test_a_job_survives_a_killed_node_then_a_cut_off_node_with_the_reference_losses(netns_stack, reference):
    cluster = netns_stack.cluster
    receiver = ReportReceiver(host=cluster.host_address)
    run = _run_spec(netns_stack, "ftjob-faults")
    jobs, sid = _submit(netns_stack, run, receiver)

    def reached(step: int, after: int = 0):
        return lambda: any(m["step"] >= step for m in receiver.metrics()[after:])

    def failures(n: int):
        return lambda: len(_messages(receiver, "Worker failure")) >= n

    try:
        # 1. a worker node dies mid-step; the job waits for capacity (the failure event says what it does)
        _wait(f"step {KILL_AFTER}", reached(KILL_AFTER), JOB_TIMEOUT_S)
        killed = cluster.workers[1]
        assert cluster.kill_node(killed) > 0
        _wait("the first failure event", failures(1), 60)
        cluster.wait_dead(killed.address, DETECTION_BOUND_S)
        cluster.replace_node(killed)  # capacity returns
        _wait("a resume after the node loss", lambda: _messages(receiver, "Resumed from checkpoint"), 180)

        # 2. a worker node is cut off: noticed within the bound, nothing hangs on its collectives
        seen = len(receiver.metrics())
        _wait(f"step {CUT_AFTER} after the resume", reached(CUT_AFTER, after=seen), JOB_TIMEOUT_S)
        cut = cluster.workers[0]
        cluster.cut(cut)
        start = time.monotonic()
        _wait("the second failure event", failures(2), DETECTION_BOUND_S)
        detected_s = time.monotonic() - start
        cluster.replace_node(cut)
        assert _wait("the job", lambda: _ended(jobs, sid), JOB_TIMEOUT_S, poll=0.5) == JobStatus.SUCCEEDED, \
            jobs.get_job_logs(sid)[-3000:]
    finally:
        receiver.server.shutdown()
        cluster.heal(cluster.workers[0])

    (result,) = receiver.of_kind("result")
    assert result.status == "succeeded", result.error
    first, second = _messages(receiver, "Worker failure")
    assert "restarting the worker group from the newest complete checkpoint" in first.message
    resumes = _messages(receiver, "Resumed from checkpoint")
    assert len(resumes) == 2 and all(e.message.endswith("after a worker failure") for e in resumes)
    assert all(e.data["step"] % CHECKPOINT_EVERY == 0 for e in resumes)
    # Exact resume: the same steps with the same losses as the uninterrupted run, and the same final numbers.
    history = _history(netns_stack, run)
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    for got, want in zip(history, reference["history"], strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], abs=1e-5), got["step"]
    assert history[-1]["valid_loss"] == pytest.approx(reference["history"][-1]["valid_loss"], abs=1e-5)
    print(f"resumed from {[e.data['step'] for e in resumes]}; cut-off node detected in {detected_s:.1f}s")
