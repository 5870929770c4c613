"""On the multi-node cluster (tests/cluster/conftest.py): one tiny EP=2 job whose two workers sit on the two worker
nodes (its expert-parallel group crosses the node boundary) runs once uninterrupted, then once through a worker
node killed mid-step (every process of its namespace) and then a worker node cut off (its link down, its
processes alive: bench.support.cluster_job.through_node_faults); the second run resumes from its newest complete
checkpoint each time and ends with the reference's losses, step for step."""

from __future__ import annotations

import os

import httpx
import pytest
from ray.job_submission import JobStatus

from bench.support.cluster_job import (CHECKPOINT_EVERY, JOB_TIMEOUT_S, STEPS, ended, history, messages, run_spec,
                                       submit, through_node_faults, wait_for)
from bench.support.netns_cluster import DETECTION_BOUND_S, NIC
from bench.support.receiver import ReportReceiver

pytestmark = pytest.mark.ray_job


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
    run = run_spec(netns_stack, "ftjob-reference")
    jobs, sid = submit(netns_stack, run, receiver)
    pages = {}
    try:
        def done():
            for node in netns_stack.cluster.workers:
                if node.address not in pages and (page := _node_series(node.address)):
                    pages[node.address] = page
            return ended(jobs, sid)

        status = wait_for("the reference job", done, JOB_TIMEOUT_S, poll=0.5)
        assert status == JobStatus.SUCCEEDED, jobs.get_job_logs(sid)[-3000:]
    finally:
        receiver.server.shutdown()
    return {"history": history(netns_stack, run), "pages": pages, "receiver": receiver}


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
    receiver = ReportReceiver(host=netns_stack.cluster.host_address)
    run = run_spec(netns_stack, "ftjob-faults")
    jobs, sid = submit(netns_stack, run, receiver)
    try:
        outcome = through_node_faults(netns_stack, receiver, jobs, sid)
    finally:
        receiver.server.shutdown()
    assert outcome["status"] == JobStatus.SUCCEEDED, jobs.get_job_logs(sid)[-3000:]
    assert max(outcome["kill_noticed_s"], outcome["cut_noticed_s"]) < DETECTION_BOUND_S

    (result,) = receiver.of_kind("result")
    assert result.status == "succeeded", result.error
    first, second = messages(receiver, "Worker failure")
    assert "restarting the worker group from the newest complete checkpoint" in first.message
    resumes = messages(receiver, "Resumed from checkpoint")
    assert len(resumes) == 2 and all(e.message.endswith("after a worker failure") for e in resumes)
    assert all(e.data["step"] % CHECKPOINT_EVERY == 0 for e in resumes)
    # Exact resume: the same steps with the same losses as the uninterrupted run, and the same final numbers.
    faulted = history(netns_stack, run)
    assert [r["step"] for r in faulted] == list(range(1, STEPS + 1))
    for got, want in zip(faulted, reference["history"], strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], abs=1e-5), got["step"]
    assert faulted[-1]["valid_loss"] == pytest.approx(reference["history"][-1]["valid_loss"], abs=1e-5)
    print(f"resumed from {[e.data['step'] for e in resumes]}; node loss noticed in {outcome['kill_noticed_s']:.1f}s,"
          f" cut-off node in {outcome['cut_noticed_s']:.1f}s")
